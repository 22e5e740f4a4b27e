"""The KV cache manager of a model with several KV cache groups, or with a
sliding-window group (vLLM's hybrid allocator and its coordinator).

One BlockPool serves every group; each group keeps its own block table per
request (core/kv_cache/single_type_manager.py). Admission and preemption
count the blocks of every group: an allocation succeeds only if the free
blocks cover what all groups need, and then every group gets its blocks. A
prefix hit is the longest prefix that every group can serve (a sliding
window needs only the blocks of its last W tokens).

Toward the scheduler this keeps KVCacheManager's interface: allocate_slots
returns group 0's new blocks and leaves the other groups' new block ids in
`new_block_ids_of_other_groups`; get_block_ids names group 0's table and
get_other_group_block_ids the others'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache.manager import KVCacheInvariantError, KVCacheManager
from pagedllm.core.kv_cache.single_type_manager import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.kv_cache_interface import KVCacheConfig
    from pagedllm.core.request import Request


def make_kv_cache_manager(
    kv_cache_config: KVCacheConfig | None, num_blocks: int, block_size: int, **kwargs: object
) -> KVCacheManager:
    """The manager `kv_cache_config` needs: the plain one for one
    full-attention group (or no config), else the hybrid one."""
    if kv_cache_config is None or kv_cache_config.is_plain:
        return KVCacheManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
    if kv_cache_config.needs_null_block and num_blocks < 2:
        raise ConfigError(
            "cache.num_kv_blocks", num_blocks, ">= 2 with a sliding-window KV cache group (one is the null block)"
        )
    return HybridKVCacheManager(kv_cache_config, num_blocks, block_size, **kwargs)


class GroupedBlocks(list[KVCacheBlock]):
    """A prefix hit: group 0's blocks (the list itself) and every group's."""

    def __init__(self, groups: Sequence[list[KVCacheBlock]]) -> None:
        super().__init__(groups[0])
        self.groups = tuple(groups)


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, kv_cache_config: KVCacheConfig, num_blocks: int, block_size: int, **kwargs: object) -> None:
        super().__init__(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
        self.kv_cache_config = kv_cache_config
        self.block_pool = BlockPool(
            num_blocks, self.enable_caching, kv_cache_config.num_groups, kv_cache_config.needs_null_block
        )
        self.managers: list[SingleTypeKVCacheManager] = [
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        ]
        # Group 0's tables are the ones KVCacheManager's callers read.
        self.req_to_blocks = self.managers[0].req_to_blocks
        self.num_cached_block = self.managers[0].num_cached_block
        # Groups 1..: the block ids the last successful allocate_slots added.
        self.new_block_ids_of_other_groups = []
        self.num_kv_cache_groups = kv_cache_config.num_groups

    # ----------------------------------------------------------- capacity

    @property
    def max_num_tokens(self) -> int:
        return self.kv_cache_config.max_num_tokens(self.block_pool.num_usable_blocks, self.num_blocks * self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        return self.kv_cache_config.max_num_blocks(num_tokens, num_tokens) <= self.block_pool.num_usable_blocks

    # ------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group can serve: (a GroupedBlocks, tokens)."""
        if not self.enable_caching:
            return [], 0
        self.request_block_hasher(request)
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # NOTE: the last position must be computed to produce logits.
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        # Each group may shorten the hit; shortening can cost a sliding
        # window its blocks, so repeat until no group shortens it.
        changed = True
        while changed and num_hit_blocks:
            changed = False
            for group_id, manager in enumerate(self.managers):
                hits[group_id] = manager.find_longest_cache_hit(request.block_hashes, num_hit_blocks)
                if len(hits[group_id]) < num_hit_blocks:
                    num_hit_blocks = len(hits[group_id])
                    changed = True
        hits = [hit[:num_hit_blocks] for hit in hits]
        num_hit_tokens = num_hit_blocks * self.block_size
        self._record_lookup(request.num_tokens, num_hit_tokens)
        return (GroupedBlocks(hits) if num_hit_blocks else []), num_hit_tokens

    def _record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.log_stats:
            self._stats_requests += 1
            self._stats_queries += num_tokens
            self._stats_hits += num_hit_tokens
            self.total_prefix_cache_requests += 1
            self.total_prefix_cache_queries += num_tokens
            self.total_prefix_cache_hits += num_hit_tokens

    # --------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots over every group: None (nothing
        allocated) unless the free blocks cover what all groups need."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0 (new={num_new_tokens}, "
                f"new_computed={num_new_computed_tokens}, lookahead={num_lookahead_tokens})"
            )
        request_id = request.request_id
        hits = self._hits_per_group(new_computed_blocks)
        # Blocks that left a window are free before this request's own count.
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_blocks_to_allocate = sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hit)
            for manager, hit in zip(self.managers, hits, strict=True)
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None
        # NOTE: nothing but window frees may change above this line.
        # Every group's hit leaves the free queue before any group takes new
        # blocks from it: a new block may evict a cached one, never a hit.
        for manager, hit in zip(self.managers, hits, strict=True):
            if hit:
                manager.save_new_computed_blocks(request_id, hit)
        new_blocks = [manager.allocate_new_blocks(request_id, num_tokens_need_slot) for manager in self.managers]
        if self.enable_caching:
            self.ensure_block_hashes(request)
            for manager in self.managers:
                manager.cache_blocks(request, num_computed_tokens + num_new_tokens)
        self.new_block_ids_of_other_groups = [[block.block_id for block in blocks] for blocks in new_blocks[1:]]
        if self.debug_checks:
            self.check_invariants()
        return new_blocks[0]

    def _hits_per_group(self, new_computed_blocks: Sequence[KVCacheBlock] | None) -> list[list[KVCacheBlock]]:
        if not new_computed_blocks:
            return [[] for _ in self.managers]
        if not isinstance(new_computed_blocks, GroupedBlocks):
            raise ValueError("a hybrid KV cache manager's prefix hit comes from its own get_computed_blocks")
        return list(new_computed_blocks.groups)

    def free(self, request: Request) -> None:
        """Release every group's blocks; each group's tail blocks are evicted first."""
        to_free: list[KVCacheBlock] = []
        for manager in self.managers:
            to_free.extend(manager.free(request))
        self.block_pool.free_blocks(to_free)
        if self.debug_checks:
            self.check_invariants()

    def get_other_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Groups 1..'s block tables of the request (null entries as the null block's id)."""
        return [
            [block.block_id for block in manager.req_to_blocks.get(request_id, ())] for manager in self.managers[1:]
        ]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's block table of the request, group 0 first."""
        return [self.get_block_ids(request_id), *self.get_other_group_block_ids(request_id)]

    # --------------------------------------------------------- invariants

    def _table_blocks(self) -> Iterable[tuple[str, list[KVCacheBlock]]]:
        null_block = self.block_pool.null_block
        for manager in self.managers:
            for request_id, req_blocks in manager.req_to_blocks.items():
                yield request_id, [block for block in req_blocks if block is not null_block]

    def _check_live_requests(self, live_requests: Iterable[Request]) -> None:
        live = {request.request_id: request for request in live_requests}
        for manager in self.managers:
            for request_id, req_blocks in manager.req_to_blocks.items():
                request = live.get(request_id)
                if request is None:
                    raise KVCacheInvariantError(f"request {request_id!r} is not live but still holds a block table")
                self._check_table(request, req_blocks, manager.group_id)
