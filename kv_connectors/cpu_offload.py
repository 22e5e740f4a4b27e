"""cpu_offload: a bounded CPU-memory tier under the paged KV cache.

When the prefix cache evicts a block (its slot is reallocated to new
tokens), the block's K/V are copied to CPU memory first, keyed by its hash;
the tier holds at most `extra.cpu_bytes` (least recently used dropped
first). A later request whose prefix misses the primary pool but hits the
tier gets those blocks copied back into freshly allocated blocks instead of
computing them.

Order within a step (the worker side, before the forward): spill the blocks
evicted by this step's allocations (their old contents are still intact:
only the forward overwrites them), then load the hits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorContext, KVConnectorMetadata
from pagedllm.kv_connectors.block_io import gather_blocks, scatter_blocks

if TYPE_CHECKING:
    from pagedllm.core.config import KVTransferConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput

TIER = "cpu"
DEFAULT_CPU_BYTES = 1 << 30


@dataclass
class CpuOffloadMetadata(KVConnectorMetadata):
    # (block id, hash) of blocks evicted by this step's allocations: copy out first.
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    # (block id, block tensor) hits to copy in.
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class CpuBlockStore:
    """hash -> block tensor, least recently used first, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        block = self._blocks.get(block_hash)
        if block is not None:
            self._blocks.move_to_end(block_hash)
        return block

    def put(self, block_hash: bytes, block: torch.Tensor) -> None:
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            return
        old = self._blocks.pop(block_hash, None)
        if old is not None:
            self.num_bytes -= old.numel() * old.element_size()
        while self._blocks and self.num_bytes + size > self.capacity_bytes:
            _, dropped = self._blocks.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()
        self._blocks[block_hash] = block
        self.num_bytes += size


class CpuOffloadConnector(KVConnectorBase):
    wants_eviction_events = True

    def __init__(self, config: KVTransferConfig, context: KVConnectorContext) -> None:
        super().__init__(config, context)
        context.kv_cache_layout.ensure_blocks_movable()
        capacity = config.extra.get("cpu_bytes", DEFAULT_CPU_BYTES)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError("kv_transfer.extra.cpu_bytes", capacity, "a positive number of bytes")
        self.store = CpuBlockStore(capacity)
        self._found: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._loads: list[tuple[int, torch.Tensor]] = []
        self._spills: list[tuple[int, bytes]] = []

    # ------------------------------------------------------ scheduler side

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        """Blocks whose cached contents this step's allocations reuse."""
        self._spills.extend(evicted)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        block_size = self.context.block_size
        first_block = num_computed_tokens // block_size
        max_blocks = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
        blocks: list[torch.Tensor] = []
        for index in range(first_block, max_blocks):
            # NOTE: the tensor is held from here on, so a spill that pushes
            # it out of the tier before the load cannot lose it.
            block = self.store.get(request.block_hashes[index])
            if block is None:
                break
            blocks.append(block)
        if first_block < max_blocks:
            self.stats.count("tier_hits", TIER, len(blocks))
            self.stats.count("tier_misses", TIER, int(len(blocks) < max_blocks - first_block))
        self.stats.external_queries += request.num_tokens
        self.stats.external_hits += len(blocks) * block_size
        if blocks:
            self._found[request.request_id] = (first_block, blocks)
        else:
            self._found.pop(request.request_id, None)
        return len(blocks) * block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, None)
        if found is None or num_external_tokens == 0:
            return
        first_block, blocks = found
        for offset, block in enumerate(blocks[: num_external_tokens // self.context.block_size]):
            self._loads.append((block_ids[first_block + offset], block))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CpuOffloadMetadata:
        metadata = CpuOffloadMetadata(spills=self._spills, loads=self._loads)
        self._spills, self._loads = [], []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._found.pop(request.request_id, None)
        return False

    # --------------------------------------------------------- worker side

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, CpuOffloadMetadata)
        spills = [(block_id, block_hash) for block_id, block_hash in metadata.spills if block_hash not in self.store]
        if spills:
            blocks = gather_blocks(self.kv_caches, [block_id for block_id, _ in spills], self.context.kv_cache_layout)
            for (_, block_hash), block in zip(spills, blocks, strict=True):
                self.store.put(block_hash, block.clone())
                self.stats.count("tier_bytes_saved", TIER, block.numel() * block.element_size())
        if metadata.loads:
            blocks = torch.stack([block for _, block in metadata.loads])
            block_ids = [block_id for block_id, _ in metadata.loads]
            scatter_blocks(self.kv_caches, block_ids, blocks, self.context.kv_cache_layout)
            self.stats.count("tier_bytes_loaded", TIER, blocks.numel() * blocks.element_size())

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "cpu_bytes": self.store.capacity_bytes, "cpu_blocks": len(self.store)}
