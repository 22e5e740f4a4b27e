"""cpu_offload: a bounded CPU-memory tier under the paged KV cache.

When the prefix cache evicts a block (its slot is reallocated to new
tokens), the block's K/V are copied to CPU memory first, keyed by its hash;
the tier holds at most `extra.cpu_bytes` per rank (least recently used
dropped first). A later request whose prefix misses the primary pool but hits
the tier gets those blocks copied back into freshly allocated blocks instead
of computing them.

The scheduler side decides everything: it keeps the tier's index (hashes,
sizes, recency; `CpuBlockIndex`) and tells the worker side, each step, which
blocks to spill, which to load and which to drop. A worker side (every rank,
with its own KV heads) only holds the tensors and does as told, so all ranks'
tiers hold the same blocks.

Order within a step (the worker side, before the forward): copy out the
blocks evicted by this step's allocations (their old contents are still
intact: only the loads and the forward overwrite them), load the hits, then
keep the copies and forget the dropped blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.core.errors import ConfigError, KVTransferError
from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorContext, KVConnectorMetadata
from pagedllm.kv_connectors.block_io import block_shape, gather_blocks, scatter_blocks

if TYPE_CHECKING:
    from pagedllm.core.config import KVTransferConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput

TIER = "cpu"
DEFAULT_CPU_BYTES = 1 << 30


@dataclass
class CpuOffloadMetadata(KVConnectorMetadata):
    # (block id, hash) of blocks evicted by this step's allocations: copy out first, keep under hash.
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    # (block id, hash) of tier hits to copy in.
    loads: list[tuple[int, bytes]] = field(default_factory=list)
    # Hashes the tier no longer holds (pushed out by this step's spills).
    drops: list[bytes] = field(default_factory=list)


class CpuBlockIndex:
    """The tier as the scheduler side sees it: hash -> bytes, least recently
    used first, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def touch(self, block_hash: bytes) -> bool:
        """Whether the tier holds `block_hash` (now its most recently used)."""
        if block_hash not in self._sizes:
            return False
        self._sizes.move_to_end(block_hash)
        return True

    def put(self, block_hash: bytes, size: int) -> list[bytes]:
        """Keep `block_hash` (unless larger than the tier); the hashes
        dropped to make room, least recently used first."""
        if size > self.capacity_bytes:
            return []
        self.num_bytes -= self._sizes.pop(block_hash, 0)
        dropped: list[bytes] = []
        while self._sizes and self.num_bytes + size > self.capacity_bytes:
            old_hash, old_size = self._sizes.popitem(last=False)
            self.num_bytes -= old_size
            dropped.append(old_hash)
        self._sizes[block_hash] = size
        self.num_bytes += size
        return dropped


class CpuOffloadConnector(KVConnectorBase):
    metadata_cls = CpuOffloadMetadata
    wants_eviction_events = True

    def __init__(self, config: KVTransferConfig, context: KVConnectorContext) -> None:
        super().__init__(config, context)
        context.kv_cache_layout.ensure_blocks_movable()
        capacity = config.extra.get("cpu_bytes", DEFAULT_CPU_BYTES)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError("kv_transfer.extra.cpu_bytes", capacity, "a positive number of bytes")
        # One rank's share of a block (every layer's K and V of its KV heads).
        shape = block_shape(context.num_layers, context.block_size, context.num_kv_heads, context.head_size,
                            context.kv_cache_layout)
        self.block_bytes = math.prod(shape) * torch.empty((), dtype=context.dtype).element_size()
        # Scheduler side: what the tier holds.
        self.index = CpuBlockIndex(capacity)
        self._found: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[tuple[int, bytes]] = []
        self._spills: list[tuple[int, bytes]] = []
        # Worker side: the blocks themselves (this rank's shard of each).
        self.blocks: dict[bytes, torch.Tensor] = {}

    # ------------------------------------------------------ scheduler side

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        """Blocks whose cached contents this step's allocations reuse."""
        self._spills.extend(evicted)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        block_size = self.context.block_size
        first_block = num_computed_tokens // block_size
        max_blocks = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
        found: list[bytes] = []
        for index in range(first_block, max_blocks):
            # NOTE: a spill that pushes a hit out of the tier later this step
            # cannot lose it: the worker side loads before it drops.
            if not self.index.touch(request.block_hashes[index]):
                break
            found.append(request.block_hashes[index])
        if first_block < max_blocks:
            self.stats.count("tier_hits", TIER, len(found))
            self.stats.count("tier_misses", TIER, int(len(found) < max_blocks - first_block))
        self.stats.external_queries += request.num_tokens
        self.stats.external_hits += len(found) * block_size
        if found:
            self._found[request.request_id] = (first_block, found)
        else:
            self._found.pop(request.request_id, None)
        return len(found) * block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._found.pop(request.request_id, None)
        if found is None or num_external_tokens == 0:
            return
        first_block, hashes = found
        for offset, block_hash in enumerate(hashes[: num_external_tokens // self.context.block_size]):
            self._loads.append((block_ids[first_block + offset], block_hash))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CpuOffloadMetadata:
        spills = [(block_id, block_hash) for block_id, block_hash in self._spills if block_hash not in self.index]
        dropped: list[bytes] = []
        for _, block_hash in spills:
            dropped.extend(self.index.put(block_hash, self.block_bytes))
        spilled = {block_hash for _, block_hash in spills}
        metadata = CpuOffloadMetadata(
            # A spill pushed out again within the step is not copied at all.
            spills=[(block_id, block_hash) for block_id, block_hash in spills if block_hash in self.index],
            loads=self._loads,
            drops=[block_hash for block_hash in dict.fromkeys(dropped) if block_hash not in spilled],
        )
        self._spills, self._loads = [], []
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._found.pop(request.request_id, None)
        return False

    # --------------------------------------------------------- worker side

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, CpuOffloadMetadata)
        layout = self.context.kv_cache_layout
        spilled = None
        if metadata.spills:
            spilled = gather_blocks(self.kv_caches, [block_id for block_id, _ in metadata.spills], layout)
        if metadata.loads:
            missing = [block_hash.hex() for _, block_hash in metadata.loads if block_hash not in self.blocks]
            if missing:  # NOTE: the scheduler side's index and this rank's tier disagree: a bug, not bad input
                raise KVTransferError(TIER, missing[0], f"not in rank {self.context.tp_rank}'s CPU tier")
            blocks = torch.stack([self.blocks[block_hash] for _, block_hash in metadata.loads])
            scatter_blocks(self.kv_caches, [block_id for block_id, _ in metadata.loads], blocks, layout)
            self.stats.count("tier_bytes_loaded", TIER, blocks.numel() * blocks.element_size())
        if spilled is not None:
            for (_, block_hash), block in zip(metadata.spills, spilled, strict=True):
                self.blocks[block_hash] = block.clone()
            self.stats.count("tier_bytes_saved", TIER, spilled.numel() * spilled.element_size())
        for block_hash in metadata.drops:
            self.blocks.pop(block_hash, None)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "cpu_bytes": self.index.capacity_bytes, "cpu_blocks": len(self.index)}
