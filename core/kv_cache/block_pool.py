"""Physical KV blocks, the free queue (eviction order) and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.events import KVEventRecorder
    from pagedllm.core.request import BlockHash, Request


class KVCacheBlock:
    """One physical block: `block_size` token slots in every layer's KV tensor."""

    __slots__ = ("block_hash", "block_id", "kv_cache_group", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # The KV cache group whose prefix cache holds it (with `block_hash`).
        self.kv_cache_group = 0
        # Number of live block tables holding this block.
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache; kept after the
        # block is freed (lazy invalidation) until it is reallocated.
        self.block_hash: BlockHash | None = None
        # Free-queue links; both None while the block is not in the queue.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # NOTE: never print the neighbours themselves (the list is cyclic-ish).
        hash_hex = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hash_hex})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) popleft, append and
    remove from the middle (a prefix hit revives a free block wherever it sits).
    The head is evicted first."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free KV cache block to pop")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} free blocks; only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block!r} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block!r} is already in the free queue")
        last = self.fake_tail.prev_free_block
        assert last is not None  # sentinel invariant, not user input
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (eviction order). O(n): tests and invariant checks only."""
        blocks = []
        block = self.fake_head.next_free_block
        while block is not None and block is not self.fake_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


class BlockPool:
    """All KV blocks, the free queue and the hash -> block map of the prefix
    cache (one map per KV cache group: each group has its own blocks for the
    same tokens).

    Every block starts free, in id order 0..N-1, except that with
    `use_null_block` block 0 is the null block: it stands in a block table
    for blocks a sliding window has freed, and is never allocated, written
    or freed.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, num_groups: int = 1, use_null_block: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block: KVCacheBlock | None = self.blocks[0] if use_null_block else None
        self.num_usable_blocks = num_blocks - use_null_block
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:] if use_null_block else self.blocks)
        # NOTE: one block per hash. A second block with the same content (two
        # requests computed it concurrently) stays unregistered.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Group g's map; group 0's is `cached_block_hash_to_block`.
        self.group_cached_blocks: list[dict[BlockHash, KVCacheBlock]] = [self.cached_block_hash_to_block] + [
            {} for _ in range(num_groups - 1)
        ]
        # (block id, hash) of cached blocks reallocated to new contents, kept
        # only while someone (a KV connector's offload tier) reads them.
        self.evicted_for_reuse: list[tuple[int, BlockHash]] | None = None
        # Hashes gained and lost, for a router that mirrors this cache (None: not recorded).
        self.kv_events: KVEventRecorder | None = None

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        return self.group_cached_blocks[group_id].get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, ref_cnt 1 each. A
        popped block still holding a hash loses it now (lazy invalidation)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks; only {self.free_block_queue.num_free_blocks} are free"
            )
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            if self.enable_caching:
                block_hash = block.block_hash
                if self._maybe_evict_cached_block(block) and self.evicted_for_reuse is not None:
                    assert block_hash is not None
                    self.evicted_for_reuse.append((block.block_id, block_hash))
            block.ref_cnt += 1
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference; a free block (a prefix hit on a freed cached
        block) leaves the free queue, so it can no longer be evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the free-queue tail in
        the given order (the first given is evicted first)."""
        now_free: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                now_free.append(block)
        self.free_block_queue.append_n(now_free)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of `request` under
        their hashes in `request.block_hashes` (which must cover them), in
        group `group_id`'s map (KV events report group 0's only)."""
        if num_full_blocks > len(request.block_hashes):
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes, "
                f"cannot cache {num_full_blocks} blocks"
            )
        cached_blocks = self.group_cached_blocks[group_id]
        for block_index in range(num_cached_blocks, num_full_blocks):
            block = blocks[block_index]
            if block is self.null_block:
                continue  # freed by a sliding window: nothing to register
            block_hash = request.block_hashes[block_index]
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise RuntimeError(
                        f"{block!r} at index {block_index} of {request.request_id!r} is cached "
                        "under another hash"
                    )
                continue  # a prefix hit: already registered
            if block_hash in cached_blocks:
                continue  # duplicate content; keep the existing block
            block.block_hash = block_hash
            block.kv_cache_group = group_id
            cached_blocks[block_hash] = block
            if self.kv_events is not None and group_id == 0:
                self.kv_events.stored(block_hash)

    def evict(self, block_ids: Iterable[int]) -> int:
        """Drop these blocks from the prefix cache (their data stays where it is,
        but no new request can hit it). Returns how many were cached."""
        return sum(self._maybe_evict_cached_block(self.blocks[block_id]) for block_id in block_ids)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        block.block_hash = None
        cached_blocks = self.group_cached_blocks[block.kv_cache_group]
        if cached_blocks.get(block_hash) is block:
            del cached_blocks[block_hash]
            if self.kv_events is not None and block.kv_cache_group == 0:
                self.kv_events.removed(block_hash)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while any
        block is in use: a running request would otherwise lose its own cache."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for cached_blocks in self.group_cached_blocks:
            cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use, 0..1 (freed cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks
