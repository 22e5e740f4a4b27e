"""KV cache groups (vLLM's hybrid allocator) with hand-computed block ids.

Layers are grouped by their KV spec; every group keeps its own block table
over one shared pool. A sliding-window group returns blocks that leave its
window (the null block, id 0, takes their place in the table); a prefix hit
must be served by every group; admission and preemption count the blocks of
every group. Block size 4 throughout.
"""

from __future__ import annotations

from types import SimpleNamespace

from helpers.scheduler_utils import make_request as make_scheduler_request

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache.hybrid_manager import HybridKVCacheManager, make_kv_cache_manager
from pagedllm.core.kv_cache.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
)
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput

BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE)
WINDOW_5 = SlidingWindowSpec(BLOCK_SIZE, sliding_window=5)
PREFIX = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks


def make_request(request_id: str, token_ids: list[int]) -> Request:
    params = SimpleNamespace(prompt_logprobs=None, structured_outputs=None)
    return Request(request_id, token_ids, params, eos_token_id=None)  # type: ignore[arg-type]


def two_group_manager(num_blocks: int) -> KVCacheManager:
    """Layer 0 full attention, layer 1 a window of 5: two groups of one layer."""
    config = get_kv_cache_config([FULL, WINDOW_5])
    return make_kv_cache_manager(config, num_blocks, BLOCK_SIZE, debug_checks=True)


def tables(manager: KVCacheManager, request_id: str) -> list[list[int]]:
    assert isinstance(manager, HybridKVCacheManager)
    return manager.get_group_block_ids(request_id)


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prompt(manager: KVCacheManager, request: Request) -> int:
    computed_blocks, num_computed_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_computed_tokens, num_computed_tokens, computed_blocks
    )
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_computed_tokens


def decode(manager: KVCacheManager, request: Request, num_steps: int) -> None:
    for step in range(num_steps):
        request.append_output_token_ids(900 + step)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


# ------------------------------------------------------------------ grouping


def test_gemma3_shaped_layers_form_one_full_and_five_sliding_groups() -> None:
    # 12 layers, every sixth global (Gemma 3's pattern): 10 sliding, 2 full.
    window = SlidingWindowSpec(BLOCK_SIZE, sliding_window=8)
    specs = [FULL if layer % 6 == 5 else window for layer in range(12)]
    config = get_kv_cache_config(specs)
    assert config.kv_cache_groups == (
        KVCacheGroupSpec((5, 11), FULL),
        KVCacheGroupSpec((0, 1), window),
        KVCacheGroupSpec((2, 3), window),
        KVCacheGroupSpec((4, 6), window),
        KVCacheGroupSpec((7, 8), window),
        KVCacheGroupSpec((9, 10), window),
    )
    # Two tensors; the i-th layer of every group shares tensor i.
    assert config.num_kv_tensors == 2
    assert config.tensor_of_layer == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)
    assert config.group_of_layer == (1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0)


def test_hybrid_off_keeps_one_full_attention_group_of_every_layer() -> None:
    specs = [WINDOW_5, FULL, WINDOW_5]
    config = get_kv_cache_config(specs, enable_hybrid=False)
    assert config.kv_cache_groups == (KVCacheGroupSpec((0, 1, 2), FULL),)
    assert config.num_kv_tensors == 3 and config.tensor_of_layer == (0, 1, 2) and config.is_plain
    # The plain config gets the plain manager: the engine's path before groups.
    assert type(make_kv_cache_manager(config, 8, BLOCK_SIZE)) is KVCacheManager


# ------------------------------------------------------ sliding-window frees


def test_sliding_window_group_frees_blocks_that_leave_the_window() -> None:
    manager = two_group_manager(num_blocks=20)  # block 0 is the null block
    request = make_request("a", [*PREFIX, 1, 2])
    schedule_prompt(manager, request)
    assert tables(manager, "a") == [[1, 2, 3], [4, 5, 6]]
    # Position 10 reads keys 6..10: block 0 of the window group is done.
    decode(manager, request, 1)
    assert tables(manager, "a") == [[1, 2, 3], [0, 5, 6]]
    assert free_ids(manager)[-1] == 4 and manager.block_pool.blocks[4].ref_cnt == 0
    decode(manager, request, 2)
    # Position 12 reads keys 8..12: block 1 is done too; both groups grew a block.
    assert tables(manager, "a") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert free_ids(manager) == [*range(9, 20), 4, 5]
    assert manager.num_free_blocks == 13
    manager.check_invariants([request])
    manager.free(request)
    assert free_ids(manager) == [*range(9, 20), 4, 5, 7, 3, 2, 1, 8, 6]


def test_full_only_model_with_hybrid_on_never_frees() -> None:
    manager = make_kv_cache_manager(get_kv_cache_config([FULL, FULL]), 20, BLOCK_SIZE, debug_checks=True)
    request = make_request("a", [*PREFIX, 1, 2])
    schedule_prompt(manager, request)
    decode(manager, request, 3)
    assert manager.get_block_ids("a") == [0, 1, 2, 3]


# -------------------------------------------------------------- prefix hits


def test_prefix_hit_with_two_groups_takes_only_the_window_blocks_it_needs() -> None:
    manager = two_group_manager(num_blocks=20)
    first = make_request("a", [*PREFIX, 1, 2])
    schedule_prompt(manager, first)
    decode(manager, first, 3)
    manager.free(first)
    second = make_request("b", [*PREFIX, 9, 9, 9])
    # Both prefix blocks hit in the full group; the window group needs only
    # the block with the 4 keys before position 8 (block 5), not block 4.
    assert schedule_prompt(manager, second) == 8
    assert tables(manager, "b") == [[1, 2, 9], [0, 5, 10]]
    assert manager.block_pool.blocks[4].ref_cnt == 0
    manager.check_invariants([second])


def test_prefix_hit_is_what_every_group_can_serve() -> None:
    manager = two_group_manager(num_blocks=20)
    first = make_request("a", [*PREFIX, 1, 2])
    schedule_prompt(manager, first)
    manager.free(first)
    # The window group's copy of block 1 is evicted: the full group alone
    # would hit 8 tokens, the window group can serve only block 0's 4.
    assert manager.evict_blocks([5]) == 1
    second = make_request("b", [*PREFIX, 9, 9, 9])
    assert schedule_prompt(manager, second) == 4
    assert tables(manager, "b")[0][:1] == [1] and tables(manager, "b")[1][:1] == [4]


def test_a_hit_block_waiting_in_the_free_queue_is_not_handed_out_as_a_new_block() -> None:
    manager = two_group_manager(num_blocks=10)
    first, other = make_request("a", [*PREFIX, 1, 2]), make_request("c", [300])
    schedule_prompt(manager, first)
    schedule_prompt(manager, other)  # takes the last fresh blocks, 7 and 8
    decode(manager, first, 3)  # the window group frees blocks 4 and 5, then reuses 4
    manager.free(other)
    assert tables(manager, "a") == [[1, 2, 3, 9], [0, 0, 6, 4]]
    assert free_ids(manager) == [5, 7, 8]  # block 5: PREFIX's second block in the window group
    second = make_request("b", [*PREFIX, 9, 9, 9, 9])
    # The window group's hit (block 5) leaves the free queue before the full
    # group takes its new block from the queue's head.
    assert schedule_prompt(manager, second) == 8
    assert tables(manager, "b") == [[1, 2, 7], [0, 5, 8]]
    manager.check_invariants([first, second])


# ------------------------------------------------- admission and preemption


def hybrid_scheduler(num_blocks: int) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    return Scheduler(config, two_group_manager(num_blocks), max_model_len=64)


def test_admission_counts_the_blocks_of_every_group() -> None:
    scheduler = hybrid_scheduler(num_blocks=8)  # 7 usable: a takes 2 + 2
    for request_id, start in (("a", 10), ("b", 20)):
        scheduler.add_request(make_scheduler_request(request_id, list(range(start, start + 6))))
    output = scheduler.schedule()
    # b would fit group 0's 2 blocks, but needs 4 of the 3 free.
    assert output.num_scheduled_tokens == {"a": 6}
    assert output.scheduled_new_reqs[0].block_ids == [1, 2]
    assert output.scheduled_new_reqs[0].other_group_block_ids == [[3, 4]]


def test_preemption_frees_every_group_of_the_victim() -> None:
    scheduler = hybrid_scheduler(num_blocks=9)  # 8 usable: a and b take 4 each
    for request_id, start in (("a", 10), ("b", 20)):
        scheduler.add_request(make_scheduler_request(request_id, list(range(start, start + 6))))
    output = scheduler.schedule()
    assert [(new.block_ids, new.other_group_block_ids) for new in output.scheduled_new_reqs] == [
        ([1, 2], [[3, 4]]),
        ([5, 6], [[7, 8]]),
    ]
    for step in range(3):
        sampled = {request_id: [1000 + step] for request_id in output.num_scheduled_tokens}
        scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))
        output = scheduler.schedule()
    # Position 8 needs a third block in each group; a's window freed block 3,
    # one short: b (the newest) is preempted and a takes 3 and 6.
    assert output.preempted_req_ids == {"b"}
    assert output.num_scheduled_tokens == {"a": 1}
    (cached,) = output.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.other_group_block_ids) == ([3], [[6]])
    assert scheduler.kv_cache_manager.num_free_blocks == 3


# ----------------------------------------------------------------- capacity


def gemma3_shaped_config(enable_hybrid: bool) -> KVCacheConfig:
    """36 layers, every sixth global, a 1,024-token window, blocks of 16."""
    window = SlidingWindowSpec(16, sliding_window=1024)
    return get_kv_cache_config([FullAttentionSpec(16) if i % 6 == 5 else window for i in range(36)], enable_hybrid)


def num_resident_sequences(config: KVCacheConfig, num_blocks: int) -> int:
    """8,191-token prompts prefilled in chunks of 2,048, then one decode
    token each (8k of context): how many the pool holds at once."""
    manager = make_kv_cache_manager(config, num_blocks, 16, enable_caching=False)
    for count in range(num_blocks):
        request = make_request(str(count), [7] * 8191)
        for num_new_tokens in (2048, 2048, 2048, 2047, 1):
            if manager.allocate_slots(request, num_new_tokens) is None:
                return count
            request.num_computed_tokens += num_new_tokens
            if request.num_computed_tokens == 8191:
                request.append_output_token_ids(7)
    raise AssertionError("the pool never filled")


def test_gemma3_shaped_groups_hold_over_three_times_the_8k_sequences() -> None:
    plain, grouped = gemma3_shaped_config(False), gemma3_shaped_config(True)
    assert (plain.num_kv_tensors, grouped.num_kv_tensors, grouped.num_groups) == (36, 6, 6)
    # The same memory: 2,048 blocks of 36 layer pages, or 12,288 of 6.
    # Full-length caches: 512 blocks a sequence, 4 sequences.
    assert num_resident_sequences(plain, 2048) == 4
    # Groups: a resident sequence holds 512 + 5 x 64 = 832 blocks; admitting
    # one more peaks at 512 + 5 x 192 = 1,472 (a 2,048-token chunk's window
    # span): 12 x 832 + 1,472 = 11,456 <= 12,287 usable (one is the null block).
    assert grouped.max_num_blocks(8192, 1) == 512 + 5 * 65  # the bound the builder sizes by
    assert num_resident_sequences(grouped, 12288) == 13
