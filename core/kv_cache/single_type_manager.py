"""The block tables of one KV cache group, by the group's spec (vLLM's
single-type managers): full attention keeps every block; a sliding window
frees the blocks that leave it and puts the pool's null block in their place.

The hybrid manager (core/kv_cache/hybrid_manager.py) runs one per group over
the shared BlockPool and sums what they need before it allocates anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.core.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
    from pagedllm.core.request import BlockHash, Request


class SingleTypeKVCacheManager:
    """Block tables of one group; full attention unless a subclass says otherwise."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were handed to cache_full_blocks.
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest hit of at most `max_num_blocks` blocks."""
        hit: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token of the request reads (none here)."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks that giving the request `num_tokens` slots takes: new
        ones, and hit blocks that sit in the free queue."""
        num_existing = len(self.req_to_blocks.get(request_id, ()))
        num_new = cdiv(num_tokens, self.block_size) - num_existing - len(new_computed_blocks)
        null_block = self.block_pool.null_block
        num_evictable = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null_block)
        return max(0, num_new) + num_evictable

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Start the request's table with its prefix hit (taking references)."""
        if request_id in self.req_to_blocks:
            raise ValueError(f"prefix-hit blocks given to {request_id!r}, which already has a block table")
        null_block = self.block_pool.null_block
        self.block_pool.touch(block for block in new_computed_blocks if block is not null_block)
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks the first `num_tokens` tokens fill."""
        request_id = request.request_id
        num_full_blocks = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        if num_full_blocks > num_cached_blocks:
            self.block_pool.cache_full_blocks(
                request, self.req_to_blocks[request_id], num_cached_blocks, num_full_blocks, self.group_id
            )
            self.num_cached_block[request_id] = num_full_blocks

    def free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request's table; its blocks, to free, in eviction order."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if req_blocks is None:
            return []
        null_block = self.block_pool.null_block
        first_uncomputed = request.num_computed_tokens // self.block_size
        # A block cached at allocation whose tokens were never computed must
        # not stay hittable (see KVCacheManager.free).
        for block in req_blocks[first_uncomputed:]:
            if block.ref_cnt == 1 and block.block_hash is not None:
                self.block_pool.evict([block.block_id])
        return [block for block in reversed(req_blocks) if block is not null_block]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block stays until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p reads keys (p - W, p]: blocks wholly before the
    next token's window go back to the pool, the null block takes their place."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(kv_cache_spec, block_pool, group_id)
        if block_pool.null_block is None:
            raise ValueError("a sliding-window group needs a block pool with a null block")
        self.null_block: KVCacheBlock = block_pool.null_block
        self.sliding_window = kv_cache_spec.sliding_window
        # A hit must end in the blocks holding the W - 1 keys before the next token.
        self.num_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """Scan right to left for `num_contiguous_blocks` cached blocks in a
        row; the blocks before them are not needed (null)."""
        max_num_blocks = min(max_num_blocks, len(block_hashes))
        hit: list[KVCacheBlock] = [self.null_block] * max_num_blocks
        num_contiguous = 0
        for index in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[index], self.group_id)
            if block is None:
                num_contiguous = 0
                continue
            hit[index] = block
            num_contiguous += 1
            if num_contiguous >= self.num_contiguous_blocks:
                return hit[: index + num_contiguous]
        # No full window anywhere: a hit from the start (every block cached) still counts.
        return hit[:num_contiguous]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        req_blocks = self.req_to_blocks.get(request_id)
        if not req_blocks:
            return
        first_needed_token = num_computed_tokens - self.sliding_window + 1
        first_needed_block = min(max(0, first_needed_token // self.block_size), len(req_blocks))
        removed: list[KVCacheBlock] = []
        for index in range(first_needed_block - 1, -1, -1):
            block = req_blocks[index]
            if block is self.null_block:
                break  # the blocks before it were removed earlier
            removed.append(block)
            req_blocks[index] = self.null_block
        if removed:
            self.block_pool.free_blocks(removed)


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, group_id: int
) -> SingleTypeKVCacheManager:
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, group_id)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, group_id)
    raise ValueError(f"no KV cache manager for {kv_cache_spec!r}")
