"""memory_store: prompt blocks shared through a process-wide in-memory store.

Scheduler side: a consumer looks the request's block hashes up past its
local prefix-cache hit; a producer notes which full prompt blocks each step
computes. Worker side: loads are copied into the paged cache before the
forward, saves copied out after it. Only the public connector interface and
`pagedllm.kv_connectors.block_io` are used.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorMetadata
from pagedllm.kv_connectors.block_io import gather_blocks, scatter_blocks
from pagedllm.plugins import get_plugin_manager
from pagedllm_example_connector.options import MemoryStoreOptions

TIER = "memory_store"


class BlockStore:
    """hash -> block; one per namespace, shared by the process's engines."""

    _stores: dict[str, BlockStore] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.blocks: dict[bytes, torch.Tensor] = {}

    @classmethod
    def named(cls, namespace: str) -> BlockStore:
        with cls._lock:
            return cls._stores.setdefault(namespace, cls())


@dataclass
class MemoryStoreMetadata(KVConnectorMetadata):
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


class MemoryStoreConnector(KVConnectorBase):
    def __init__(self, config: Any, context: Any) -> None:
        super().__init__(config, context)
        namespace = config.extra.get("namespace")
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError("kv_transfer.extra.namespace", namespace, "a non-empty store name")
        # Different models never share blocks, even in one namespace.
        self.store = BlockStore.named(f"{namespace}/{context.model_fingerprint}")
        # This plugin's options (plugins.config.example_connector), validated at load.
        self.options = get_plugin_manager().plugin_config(MemoryStoreOptions)
        self._requests: dict[str, tuple[Any, list[int]]] = {}
        self._found: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._loads: list[tuple[int, torch.Tensor]] = []
        self._metadata = MemoryStoreMetadata()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        if not self.is_consumer:
            return 0
        block_size = self.context.block_size
        first = num_computed_tokens // block_size
        last = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
        blocks = []
        for index in range(first, last):
            block = self.store.blocks.get(request.block_hashes[index])
            if block is None:
                break
            blocks.append(block)
        self.stats.external_queries += request.num_tokens
        self.stats.external_hits += len(blocks) * block_size
        self.stats.count("tier_hits", TIER, len(blocks))
        if blocks:
            self._found[request.request_id] = (first, blocks)
        return len(blocks) * block_size

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self._requests[request.request_id] = (request, list(block_ids))
        first, blocks = self._found.pop(request.request_id, (0, []))
        for offset, block in enumerate(blocks[: num_external_tokens // self.context.block_size]):
            self._loads.append((block_ids[first + offset], block))

    def build_connector_meta(self, scheduler_output: Any) -> MemoryStoreMetadata:
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.req_id in self._requests and not cached.resumed_from_preemption:
                self._requests[cached.req_id][1].extend(cached.new_block_ids)
        saves = []
        if self.is_producer:
            block_size = self.context.block_size
            for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
                request, block_ids = self._requests.get(req_id, (None, []))
                if request is None:
                    continue
                start = request.num_computed_tokens
                end = min(start + num_new_tokens, request.num_prompt_tokens) // block_size
                for index in range(start // block_size, min(end, len(request.block_hashes))):
                    if request.block_hashes[index] not in self.store.blocks:
                        saves.append((block_ids[index], request.block_hashes[index]))
        loads, self._loads = self._loads, []
        return MemoryStoreMetadata(loads=loads, saves=saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        self._requests.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        return False

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MemoryStoreMetadata)
        self._metadata = metadata
        if metadata.loads:
            scatter_blocks(self.kv_caches, [b for b, _ in metadata.loads], torch.stack([t for _, t in metadata.loads]))

    def wait_for_save(self) -> None:
        saves, self._metadata = self._metadata.saves, MemoryStoreMetadata()
        if saves:
            blocks = gather_blocks(self.kv_caches, [block_id for block_id, _ in saves])
            for (_, block_hash), block in zip(saves, blocks):
                if self.options.max_blocks is not None and len(self.store.blocks) >= self.options.max_blocks:
                    break  # the store is full
                self.store.blocks[block_hash] = block.clone()
                self.stats.count("tier_bytes_saved", TIER, block.numel() * block.element_size())
