"""KV-manager scenarios with hand-computed block ids (block_size 4).

Each test simulates the scheduler: get_computed_blocks -> allocate_slots ->
(the step runs) num_computed_tokens += scheduled -> ... -> free.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache import KVCacheInvariantError, KVCacheManager, PrefixCacheStats
from pagedllm.core.request import Request

BLOCK_SIZE = 4


def make_request(
    request_id: str, token_ids: list[int], prompt_logprobs: int | None = None, **kwargs: object
) -> Request:
    params = SimpleNamespace(prompt_logprobs=prompt_logprobs, structured_outputs=None)
    return Request(request_id, token_ids, params, eos_token_id=None, **kwargs)


def make_manager(num_blocks: int = 10, **kwargs: object) -> KVCacheManager:
    # Invariants checked after every allocate/free unless a test corrupts them.
    kwargs.setdefault("debug_checks", True)
    return KVCacheManager(num_blocks, BLOCK_SIZE, **kwargs)


def schedule_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """First scheduling of a whole prompt, then the step 'runs'. Returns new block ids."""
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - num_computed_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return [block.block_id for block in new_blocks]


def decode_step(manager: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Sample one token, then schedule it in the next step."""
    request.append_output_token_ids(token_id)
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is None:
        return None
    request.num_computed_tokens += 1
    return [block.block_id for block in new_blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def cached_ids(manager: KVCacheManager, request: Request) -> list[int | None]:
    found = [manager.block_pool.get_cached_block(h) for h in request.block_hashes]
    return [block.block_id if block is not None else None for block in found]


PREFIX = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks


def test_first_prompt_takes_head_blocks_and_caches_only_full_blocks() -> None:
    manager = make_manager()
    request = make_request("a", PREFIX + [1, 2])  # 10 tokens: 2 full blocks + 2
    assert schedule_prompt(manager, request) == [0, 1, 2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert len(request.block_hashes) == 2
    assert cached_ids(manager, request) == [0, 1]
    assert manager.block_pool.blocks[2].block_hash is None
    assert manager.num_free_blocks == 7 and manager.usage == pytest.approx(0.3)
    manager.check_invariants([request])


def test_hit_while_owner_still_runs_shares_the_same_blocks() -> None:
    manager = make_manager()
    owner = make_request("a", PREFIX + [1, 2])
    schedule_prompt(manager, owner)
    reader = make_request("b", PREFIX + [7, 8, 9])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(reader)
    assert [b.block_id for b in computed_blocks] == [0, 1] and num_computed_tokens == 8
    assert ref_counts(manager)[:2] == [1, 1]  # a lookup takes no reference
    new_blocks = manager.allocate_slots(reader, 3, num_computed_tokens, computed_blocks)
    assert [b.block_id for b in new_blocks] == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    manager.check_invariants([owner, reader])


def test_siblings_scheduled_in_the_same_step_share_prompt_blocks() -> None:
    # n > 1: the second sibling looks up before the first one's step ran.
    manager = make_manager()
    first, second = make_request("r-0", PREFIX + [1]), make_request("r-1", PREFIX + [1])
    assert manager.allocate_slots(first, 9) is not None  # num_computed_tokens still 0
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(second)
    assert [b.block_id for b in computed_blocks] == [0, 1] and num_computed_tokens == 8
    assert [b.block_id for b in manager.allocate_slots(second, 1, 8, computed_blocks)] == [3]
    assert manager.get_block_ids("r-1") == [0, 1, 3]


def test_free_queue_order_after_frees() -> None:
    manager = make_manager()
    first, second = make_request("a", PREFIX + [1, 2]), make_request("b", [50, 51, 52, 53, 54, 55])
    assert schedule_prompt(manager, first) == [0, 1, 2]
    assert schedule_prompt(manager, second) == [3, 4]
    manager.free(first)
    # Reverse table order: a request's tail block is evicted before its head.
    assert free_ids(manager) == [5, 6, 7, 8, 9, 2, 1, 0]
    manager.free(second)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    assert manager.get_block_ids("a") == [] and manager.usage == 0.0
    manager.free(second)  # idempotent
    manager.check_invariants([])


def test_freed_cached_block_is_revived_by_a_later_hit() -> None:
    manager = make_manager()
    first, second = make_request("a", PREFIX + [1, 2]), make_request("b", [50, 51, 52, 53, 54, 55])
    schedule_prompt(manager, first)
    schedule_prompt(manager, second)
    manager.free(first)
    manager.free(second)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]

    later = make_request("c", PREFIX + [9, 9, 9])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(later)
    assert [b.block_id for b in computed_blocks] == [0, 1] and num_computed_tokens == 8
    assert manager.allocate_slots(later, 3, 8, computed_blocks)[0].block_id == 5
    # Blocks 1 and 0 left the middle of the queue, keeping their ids and hashes.
    assert manager.get_block_ids("c") == [0, 1, 5]
    assert free_ids(manager) == [6, 7, 8, 9, 2, 4, 3]
    assert cached_ids(manager, later) == [0, 1]
    manager.check_invariants([later])


def test_eviction_pops_head_and_invalidates_lazily() -> None:
    manager = make_manager(num_blocks=4)
    first = make_request("a", PREFIX + [1])  # blocks 0, 1 cached; 2 partial
    assert schedule_prompt(manager, first) == [0, 1, 2]
    manager.free(first)
    assert free_ids(manager) == [3, 2, 1, 0]
    assert cached_ids(manager, first) == [0, 1]  # freed but still hittable

    other = make_request("b", [60, 61, 62, 63, 64, 65, 66])  # needs 2 blocks
    assert schedule_prompt(manager, other) == [3, 2]
    assert cached_ids(manager, first) == [0, 1]  # the uncached blocks went first

    third = make_request("c", [70, 71, 72])  # needs 1 block: evicts the head
    assert schedule_prompt(manager, third) == [1]
    assert cached_ids(manager, first) == [0, None]
    assert manager.block_pool.blocks[1].block_hash is None

    again = make_request("d", PREFIX + [1])
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in computed_blocks] == [0] and num_computed_tokens == 4
    manager.check_invariants([other, third])


def test_partial_block_is_cached_once_decoding_fills_it() -> None:
    manager = make_manager()
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    assert schedule_prompt(manager, request) == [0, 1]
    assert cached_ids(manager, request) == [0]
    assert decode_step(manager, request, 7) == []  # 7 tokens computed
    assert manager.block_pool.blocks[1].block_hash is None
    # Token 8 is sampled: the block is full but its K/V is not computed yet.
    request.append_output_token_ids(8)
    assert len(request.block_hashes) == 1
    assert manager.allocate_slots(request, 1) == []  # step computes token 8
    request.num_computed_tokens += 1
    assert cached_ids(manager, request) == [0, 1]
    assert decode_step(manager, request, 9) == [2]
    manager.check_invariants([request])


def test_hit_covers_at_most_prompt_len_minus_one() -> None:
    manager = make_manager()
    owner = make_request("a", PREFIX)  # exactly 2 blocks
    assert schedule_prompt(manager, owner) == [0, 1]
    assert cached_ids(manager, owner) == [0, 1]
    same = make_request("b", PREFIX)
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(same)
    assert [b.block_id for b in computed_blocks] == [0] and num_computed_tokens == 4
    assert schedule_prompt(manager, make_request("c", [1])) == [2]
    new_blocks = manager.allocate_slots(same, 4, 4, computed_blocks)
    assert [b.block_id for b in new_blocks] == [3]
    # Block 3 holds the same content as block 1; block 1 stays the cached one.
    assert manager.block_pool.blocks[3].block_hash is None
    assert cached_ids(manager, same) == [0, 1]


def test_salt_changes_the_chain() -> None:
    manager = make_manager()
    salted = make_request("a", PREFIX + [1], cache_salt="tenant-1")
    assert schedule_prompt(manager, salted) == [0, 1, 2]
    for request_id, salt in (("b", None), ("c", "tenant-2")):
        stranger = make_request(request_id, PREFIX + [1], cache_salt=salt)
        assert manager.get_computed_blocks(stranger) == ([], 0)
    friend = make_request("d", PREFIX + [1], cache_salt="tenant-1")
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(friend)
    assert [b.block_id for b in computed_blocks] == [0, 1] and num_computed_tokens == 8


def test_failed_allocation_changes_nothing() -> None:
    manager = make_manager(num_blocks=5)
    first = make_request("a", PREFIX + [1])
    assert schedule_prompt(manager, first) == [0, 1, 2]
    manager.free(first)
    runner = make_request("r", [40, 41])
    assert schedule_prompt(manager, runner) == [3]
    assert free_ids(manager) == [4, 2, 1, 0]

    # 17 tokens = 5 blocks: 2 hit blocks (both sitting in the free queue) + 3
    # new. 4 blocks are free, but 2 of them are the hits themselves.
    big = make_request("b", PREFIX + list(range(200, 209)))
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(big)
    assert [b.block_id for b in computed_blocks] == [0, 1]
    stats_before = manager.take_prefix_cache_stats()
    refs_before, cached_before = ref_counts(manager), cached_ids(manager, big)
    assert manager.allocate_slots(big, 9, num_computed_tokens, computed_blocks) is None
    assert ref_counts(manager) == refs_before == [0, 0, 0, 1, 0]
    assert free_ids(manager) == [4, 2, 1, 0]
    assert cached_ids(manager, big) == cached_before == [0, 1, None, None]
    assert "b" not in manager.req_to_blocks and "b" not in manager.num_cached_block
    assert manager.take_prefix_cache_stats() == PrefixCacheStats()
    assert stats_before.hits == 8

    # A running request that cannot grow keeps its table as it was.
    runner.append_output_token_ids([42, 43, 44])
    assert manager.allocate_slots(runner, 3, num_lookahead_tokens=20) is None
    assert manager.get_block_ids("r") == [3] and ref_counts(manager) == [0, 0, 0, 1, 0]
    manager.check_invariants([runner])


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    manager = make_manager()
    request = make_request("a", list(range(12)))  # 3 full blocks, all hashed
    # A 5-token prefill chunk with 4 lookahead slots: blocks 0..2, but only
    # block 0 holds computed tokens.
    new_blocks = manager.allocate_slots(request, 5, num_lookahead_tokens=4)
    assert [b.block_id for b in new_blocks] == [0, 1, 2]
    assert len(request.block_hashes) == 3
    assert cached_ids(manager, request) == [0, None, None]


def test_draft_tokens_are_never_cached() -> None:
    manager = make_manager()
    request = make_request("a", [1, 2, 3, 4, 5])
    assert schedule_prompt(manager, request) == [0, 1]
    request.append_output_token_ids(6)
    request.spec_token_ids = [7, 8, 9]  # block 1 would be full with the drafts
    assert manager.allocate_slots(request, 1 + len(request.spec_token_ids)) == [manager.block_pool.blocks[2]]
    assert manager.block_pool.blocks[1].block_hash is None
    assert cached_ids(manager, request) == [0]


def test_prompt_logprobs_request_takes_no_hit_but_fills_the_cache() -> None:
    manager = make_manager()
    owner = make_request("a", PREFIX + [1])
    schedule_prompt(manager, owner)
    wants_logprobs = make_request("b", PREFIX + [1], prompt_logprobs=0)
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)
    assert len(wants_logprobs.block_hashes) == 2
    assert schedule_prompt(manager, wants_logprobs) == [3, 4, 5]
    manager.free(owner)
    manager.free(wants_logprobs)
    # Block 0/1 keep the cache entries (first writer wins); the duplicates do not.
    assert cached_ids(manager, wants_logprobs) == [0, 1]


def test_caching_disabled_never_hits() -> None:
    manager = make_manager(enable_caching=False)
    first = make_request("a", PREFIX + [1])
    assert schedule_prompt(manager, first) == [0, 1, 2]
    assert first.block_hashes == [] and manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("b", PREFIX + [1])) == ([], 0)
    assert manager.take_prefix_cache_stats() == PrefixCacheStats()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    manager = make_manager()
    first = make_request("a", PREFIX + [1])
    schedule_prompt(manager, first)
    assert manager.reset_prefix_cache() is False
    assert cached_ids(manager, first) == [0, 1]
    assert manager.take_prefix_cache_stats().reset is False
    manager.free(first)
    assert manager.reset_prefix_cache() is True
    assert manager.take_prefix_cache_stats().reset is True
    assert manager.get_computed_blocks(make_request("b", PREFIX + [1])) == ([], 0)
    manager.check_invariants([])


def test_stats_count_tokens_per_interval() -> None:
    manager = make_manager()
    schedule_prompt(manager, make_request("a", PREFIX + [1, 2]))
    schedule_prompt(manager, make_request("b", PREFIX + [3, 4, 5]))
    stats = manager.take_prefix_cache_stats()
    assert (stats.queries, stats.hits, stats.requests) == (21, 8, 2)
    assert stats.hit_rate == pytest.approx(8 / 21)
    assert manager.take_prefix_cache_stats() == PrefixCacheStats(queries=0, hits=0, requests=0)
    schedule_prompt(manager, make_request("c", PREFIX + [6]))
    assert manager.take_prefix_cache_stats() == PrefixCacheStats(queries=9, hits=8, requests=1)
    assert (manager.total_prefix_cache_queries, manager.total_prefix_cache_hits) == (30, 16)


def test_log_stats_off_counts_nothing() -> None:
    manager = make_manager(log_stats=False)
    schedule_prompt(manager, make_request("a", PREFIX + [1]))
    schedule_prompt(manager, make_request("b", PREFIX + [1]))
    assert manager.take_prefix_cache_stats() == PrefixCacheStats()


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_both_hash_algorithms_give_hits(algo: str) -> None:
    manager = make_manager(hash_algo=algo)
    owner = make_request("a", PREFIX + [1])
    schedule_prompt(manager, owner)
    assert len(owner.block_hashes[0]) == (32 if algo == "sha256" else 16)
    assert schedule_prompt(manager, make_request("b", PREFIX + [2])) == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]


def test_unknown_hash_algo_and_bad_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        KVCacheManager(4, 4, hash_algo="md5")
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        KVCacheManager(0, 4)
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(4, 0)


def test_capacity_helpers() -> None:
    manager = make_manager(num_blocks=3)
    assert manager.max_num_tokens == 12
    assert manager.can_fit(12) and not manager.can_fit(13)


def test_invariant_checker_catches_a_corrupted_ref_count() -> None:
    manager = make_manager(debug_checks=False)
    request = make_request("a", PREFIX + [1])
    schedule_prompt(manager, request)
    manager.check_invariants([request])
    manager.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(KVCacheInvariantError, match="block 1 has ref_cnt 2 but 1 live block tables hold it"):
        manager.check_invariants([request])


def test_invariant_checker_catches_leaks_and_queue_corruption() -> None:
    manager = make_manager(num_blocks=4, debug_checks=False)
    request = make_request("a", [1, 2, 3, 4, 5])
    schedule_prompt(manager, request)
    with pytest.raises(KVCacheInvariantError, match="'a' is not live"):
        manager.check_invariants([])
    manager.block_pool.free_block_queue.remove(manager.block_pool.blocks[3])
    with pytest.raises(KVCacheInvariantError, match="block 3 has ref_cnt 0 but is in the free queue 0 times"):
        manager.check_invariants([request])


def test_invariant_checker_catches_a_wrong_cache_entry() -> None:
    manager = make_manager(debug_checks=False)
    first = make_request("a", PREFIX + [1])
    schedule_prompt(manager, first)
    pool = manager.block_pool
    pool.cached_block_hash_to_block[first.block_hashes[0]] = pool.blocks[1]
    with pytest.raises(KVCacheInvariantError, match="points to block 1"):
        manager.check_invariants([first])


def test_debug_env_checks_after_every_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    manager = KVCacheManager(6, BLOCK_SIZE)
    assert manager.debug_checks is True
    schedule_prompt(manager, make_request("a", [1, 2, 3]))
    manager.block_pool.blocks[0].ref_cnt = 5
    with pytest.raises(KVCacheInvariantError):
        manager.allocate_slots(make_request("b", [4]), 1)
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "0")
    assert KVCacheManager(6, BLOCK_SIZE).debug_checks is False


def test_blocks_preempted_before_their_step_ran_are_not_left_hittable() -> None:
    # The scheduler allocated this step's blocks, then preempted the request
    # before the step ran (num_computed_tokens not advanced yet).
    manager = make_manager()
    victim = make_request("v", PREFIX + [1])
    schedule_prompt(manager, victim)  # 9 computed, blocks [0, 1, 2]
    victim.append_output_token_ids([2, 3, 4, 5, 6, 7, 8])  # 16 tokens
    assert [b.block_id for b in manager.allocate_slots(victim, 7)] == [3]
    assert cached_ids(manager, victim) == [0, 1, 2, 3]
    manager.free(victim)  # still num_computed_tokens == 9
    assert cached_ids(manager, victim) == [0, 1, None, None]
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    manager.check_invariants([])
