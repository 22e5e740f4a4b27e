"""KV cache manager: per-request block tables over one BlockPool, prefix-cache
lookups, allocation for the scheduler, and an invariant checker."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError, PagedLLMError
from pagedllm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache.events import KVEventRecorder
from pagedllm.core.kv_cache.hashing import get_hash_fn, get_request_block_hasher

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.events import KVCacheEvent
    from pagedllm.core.request import BlockHash, Request

DEBUG_ENV_VAR = "PAGEDLLM_DEBUG_KV"


class KVCacheInvariantError(PagedLLMError, RuntimeError):
    """The block accounting is inconsistent (a bug, never a user error)."""


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last take: queries and hits in tokens."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    # True when reset_prefix_cache() succeeded in this interval.
    reset: bool = False

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for every running request, backed by one BlockPool.

    The scheduler calls, per request: get_computed_blocks() once when it first
    schedules it (or resumes it after preemption), allocate_slots() every step
    it runs, free() when it finishes or is preempted.

    This is the manager of one full-attention group (every layer alike);
    core/kv_cache/hybrid_manager.py serves several groups or sliding windows.
    """

    # Block tables per request; the hybrid manager's other groups send
    # their new block ids beside group 0's.
    num_kv_cache_groups = 1
    new_block_ids_of_other_groups: list[list[int]] = []  # noqa: RUF012 - never mutated here

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = True,
        debug_checks: bool | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ConfigError(key="num_kv_blocks", value=num_blocks, allowed="an integer >= 1")
        if block_size < 1:
            raise ConfigError(key="block_size", value=block_size, allowed="an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.log_stats = log_stats
        self.debug_checks = os.environ.get(DEBUG_ENV_VAR) == "1" if debug_checks is None else debug_checks
        # Validated even with caching off so a typo never hides until enabled.
        self.request_block_hasher = get_request_block_hasher(block_size, get_hash_fn(hash_algo))
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request were handed to cache_full_blocks.
        self.num_cached_block: dict[str, int] = {}

        self._stats_queries = 0
        self._stats_hits = 0
        self._stats_requests = 0
        self._stats_reset = False
        # Cumulative since construction (never reset by take_prefix_cache_stats).
        self.total_prefix_cache_queries = 0
        self.total_prefix_cache_hits = 0
        self.total_prefix_cache_requests = 0

    # ----------------------------------------------------------- capacity

    @property
    def max_num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` could ever fit the whole pool."""
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # ------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`: (blocks, number of tokens).

        The blocks are not referenced yet: pass them to allocate_slots(), which
        takes the references only if the allocation succeeds.
        """
        if not self.enable_caching:
            return [], 0
        self.request_block_hasher(request)
        if request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position.
            return [], 0
        # NOTE: the last position must be computed to produce logits.
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        num_hit_tokens = len(computed_blocks) * self.block_size
        if self.log_stats:
            self._stats_requests += 1
            self._stats_queries += request.num_tokens
            self._stats_hits += num_hit_tokens
            self.total_prefix_cache_requests += 1
            self.total_prefix_cache_queries += request.num_tokens
            self.total_prefix_cache_hits += num_hit_tokens
        return computed_blocks, num_hit_tokens

    # --------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` (after its
        `num_computed_tokens` and any prefix hit) plus `num_lookahead_tokens`
        draft slots.

        Returns the newly allocated blocks (not the hit ones), or None when the
        free blocks are not enough; then nothing at all has changed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0 (new={num_new_tokens}, "
                f"new_computed={num_new_computed_tokens}, lookahead={num_lookahead_tokens})"
            )
        # NOTE: this runs for every scheduled request every step; keep the
        # decode path (no hit, usually no new block) free of needless work.
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_existing_blocks = 0 if req_blocks is None else len(req_blocks)
        num_evictable_hit_blocks = 0
        if new_computed_blocks:
            new_computed_blocks, num_evictable_hit_blocks = self._check_hit_blocks(
                request_id, num_existing_blocks, new_computed_blocks
            )
        else:
            new_computed_blocks = ()

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_blocks_to_allocate = (
            -(-num_tokens_need_slot // self.block_size) - num_existing_blocks - len(new_computed_blocks)
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks - num_evictable_hit_blocks:
            return None

        # NOTE: nothing may change above this line (a failed allocation is a no-op).
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        if num_blocks_to_allocate > 0:
            new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens, len(new_computed_blocks))
        if self.debug_checks:
            self.check_invariants()
        return new_blocks

    def _check_hit_blocks(
        self, request_id: str, num_existing_blocks: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> tuple[list[KVCacheBlock], int]:
        """Prefix-hit blocks as a list, and how many of them are in the free queue."""
        if num_existing_blocks:
            raise ValueError(f"prefix-hit blocks given to {request_id!r}, which already has a block table")
        # A hit on a freed cached block takes it out of the free queue, so it
        # cannot also serve as a new block.
        num_evictable_hit_blocks = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return list(new_computed_blocks), num_evictable_hit_blocks

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int, num_hit_blocks: int
    ) -> None:
        """Register the blocks that the first `num_tokens` tokens fill in the prefix cache."""
        # NOTE: caching at allocation, before the K/V exist, is safe: the
        # attention backend writes a step's new K/V before reading, so a
        # request hitting these blocks in this same step reads them computed.
        # This is what lets n > 1 siblings share their prompt blocks.
        block_hashes = request.block_hashes
        if request.num_tokens // self.block_size > len(block_hashes):
            self.request_block_hasher(request)
        num_full_blocks = min(num_tokens // self.block_size, len(block_hashes))
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, num_hit_blocks)
        if num_full_blocks > num_cached_blocks:
            self.block_pool.cache_full_blocks(request, req_blocks, num_cached_blocks, num_full_blocks)
            num_cached_blocks = num_full_blocks
        self.num_cached_block[request_id] = num_cached_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (finished, aborted or preempted).

        Blocks go to the free-queue tail in reverse table order, so the
        request's tail blocks (the least shareable) are evicted first.
        """
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if req_blocks is None:
            return
        if self.enable_caching:
            # A block cached at allocation whose tokens were never computed
            # (the request was preempted in the same step it was scheduled)
            # must not stay hittable once nobody computes it.
            first_uncomputed = request.num_computed_tokens // self.block_size
            for block in req_blocks[first_uncomputed:]:
                if block.ref_cnt == 1 and block.block_hash is not None:
                    self.block_pool.evict([block.block_id])
        self.block_pool.free_blocks(reversed(req_blocks))
        if self.debug_checks:
            self.check_invariants()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_other_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of groups after the first (none here)."""
        return []

    # ------------------------------------------------------- prefix cache

    def ensure_block_hashes(self, request: Request) -> None:
        """Hash every full block of `request` (even with caching off: a KV
        connector names blocks by these hashes)."""
        if request.num_tokens // self.block_size > len(request.block_hashes):
            self.request_block_hasher(request)

    def record_evictions(self) -> None:
        """From now on remember each cached block reallocated to new
        contents; `take_evicted_blocks` hands them over."""
        if self.block_pool.evicted_for_reuse is None:
            self.block_pool.evicted_for_reuse = []

    def take_evicted_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) reallocated since the last call, oldest first."""
        evicted = self.block_pool.evicted_for_reuse or []
        if self.block_pool.evicted_for_reuse is not None:
            self.block_pool.evicted_for_reuse = []
        return evicted

    def record_kv_events(self) -> None:
        """From now on record the hashes the prefix cache gains and loses;
        `take_kv_events` hands them over (a router mirrors them)."""
        if self.block_pool.kv_events is None:
            self.block_pool.kv_events = KVEventRecorder()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events since the last call, in order (none when not recorded)."""
        recorder = self.block_pool.kv_events
        return [] if recorder is None else recorder.take()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats_reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Remove these blocks from the prefix cache; returns how many were cached."""
        return self.block_pool.evict(block_ids)

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call (then reset to zero)."""
        stats = PrefixCacheStats(
            queries=self._stats_queries,
            hits=self._stats_hits,
            requests=self._stats_requests,
            reset=self._stats_reset,
        )
        self._stats_queries = self._stats_hits = self._stats_requests = 0
        self._stats_reset = False
        return stats

    # --------------------------------------------------------- invariants

    def check_invariants(self, live_requests: Iterable[Request] | None = None) -> None:
        """Raise KVCacheInvariantError unless the block accounting is consistent.

        With `live_requests`, also check that only they hold block tables, that
        each table covers the request's computed tokens, and that every cached
        block in a table holds exactly the request's tokens at that position.
        """
        self._check_ref_counts()
        self._check_cache_map()
        if live_requests is not None:
            self._check_live_requests(live_requests)

    def _table_blocks(self) -> Iterable[tuple[str, list[KVCacheBlock]]]:
        """(request id, the real blocks of one of its tables), every table."""
        return self.req_to_blocks.items()

    def _check_ref_counts(self) -> None:
        """Each block's ref_cnt counts the tables holding it; free means ref_cnt 0."""
        pool = self.block_pool
        expected_refs = [0] * self.num_blocks
        for request_id, req_blocks in self._table_blocks():
            seen: set[int] = set()
            for block in req_blocks:
                if block.block_id in seen:
                    raise KVCacheInvariantError(f"block {block.block_id} appears twice in the table of {request_id!r}")
                seen.add(block.block_id)
                expected_refs[block.block_id] += 1

        free_blocks = pool.free_block_queue.get_all_free_blocks()
        in_free_queue = [0] * self.num_blocks
        for block in free_blocks:
            in_free_queue[block.block_id] += 1
        if len(free_blocks) != pool.free_block_queue.num_free_blocks:
            raise KVCacheInvariantError(
                f"free queue holds {len(free_blocks)} blocks but counts {pool.free_block_queue.num_free_blocks}"
            )

        num_used = 0
        for block in pool.blocks:
            block_id = block.block_id
            if block is pool.null_block:
                if block.ref_cnt or in_free_queue[block_id] or expected_refs[block_id] or block.block_hash:
                    raise KVCacheInvariantError(f"the null block {block_id} is referenced, free or cached")
                continue
            if block.ref_cnt != expected_refs[block_id]:
                raise KVCacheInvariantError(
                    f"block {block_id} has ref_cnt {block.ref_cnt} but {expected_refs[block_id]} "
                    "live block tables hold it"
                )
            if block.ref_cnt > 0:
                num_used += 1
                if in_free_queue[block_id]:
                    raise KVCacheInvariantError(f"block {block_id} is in the free queue with ref_cnt {block.ref_cnt}")
            elif in_free_queue[block_id] != 1:
                raise KVCacheInvariantError(
                    f"block {block_id} has ref_cnt 0 but is in the free queue {in_free_queue[block_id]} times"
                )
        if num_used + len(free_blocks) != pool.num_usable_blocks:
            raise KVCacheInvariantError(
                f"free ({len(free_blocks)}) + used ({num_used}) != total ({pool.num_usable_blocks})"
            )

    def _check_cache_map(self) -> None:
        """The hash -> block maps and the blocks' own hashes and groups agree."""
        pool = self.block_pool
        for group_id, cached_blocks in enumerate(pool.group_cached_blocks):
            for block_hash, block in cached_blocks.items():
                if block.block_hash != block_hash or block.kv_cache_group != group_id:
                    raise KVCacheInvariantError(
                        f"group {group_id}'s cache map entry {block_hash.hex()[:16]} points to block "
                        f"{block.block_id} whose hash is {block.block_hash.hex()[:16] if block.block_hash else None}"
                    )
        for block in pool.blocks:
            if block.block_hash is not None and (
                pool.group_cached_blocks[block.kv_cache_group].get(block.block_hash) is not block
            ):
                raise KVCacheInvariantError(f"block {block.block_id} has a hash but is not registered under it")

    def _check_live_requests(self, live_requests: Iterable[Request]) -> None:
        """Only live requests hold tables, each covering its computed tokens
        and caching only its own block hashes."""
        live = {request.request_id: request for request in live_requests}
        for request_id in self.req_to_blocks:
            if request_id not in live:
                raise KVCacheInvariantError(f"request {request_id!r} is not live but still holds a block table")
        for request_id, request in live.items():
            req_blocks = self.req_to_blocks.get(request_id)
            if req_blocks is not None:
                self._check_table(request, req_blocks, 0)

    def _check_table(self, request: Request, req_blocks: list[KVCacheBlock], group_id: int) -> None:
        """One table of a live request covers its computed tokens; each
        cached block in it holds the request's tokens at that index."""
        request_id = request.request_id
        if len(req_blocks) * self.block_size < request.num_computed_tokens:
            raise KVCacheInvariantError(
                f"request {request_id!r} has {request.num_computed_tokens} computed tokens but only "
                f"{len(req_blocks)} blocks of {self.block_size} in group {group_id}"
            )
        for index, block in enumerate(req_blocks):
            if block.block_hash is None or block is self.block_pool.null_block:
                continue
            if index >= len(request.block_hashes) or request.block_hashes[index] != block.block_hash:
                raise KVCacheInvariantError(
                    f"block {block.block_id} at index {index} of {request_id!r} is cached under a hash "
                    "that is not the request's own block hash there"
                )
