"""Scheduler scenarios with hand-computed chunk sizes, orders, victims and block ids.

The Scheduler runs on a real KVCacheManager (block_size 4, small pools) and a
FakeRunner (tests/helpers/scheduler_utils.py) that mirrors the model runner's
state from the SchedulerOutputs alone and samples one token for each request
that reaches the end of its known tokens. The block invariant is checked after
every schedule() and every update_from_output().

Free-queue arithmetic used below: blocks start free in id order; a request's
blocks are freed in reverse table order to the tail; new blocks pop the head.
"""

from __future__ import annotations

import pytest
from helpers.scheduler_utils import (
    DEFAULT_TOKEN_BASE,
    EOS,
    FakeRunner,
    make_request,
    make_scheduler,
    prompt,
)

from pagedllm.core.errors import ConfigError
from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler_output import CachedRequestData

T = DEFAULT_TOKEN_BASE  # the FakeRunner's k-th sampled token of a request is T + k


def free_block_ids(scheduler) -> list[int]:
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    return [block.block_id for block in queue.get_all_free_blocks()]


def run_until_done(runner: FakeRunner, max_steps: int = 100) -> int:
    for num_steps in range(1, max_steps + 1):
        runner.step()
        if not runner.scheduler.has_unfinished_requests():
            return num_steps
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {runner.scheduler.requests}")


# ------------------------------------------------------------ token budget


def test_chunked_prefill_splits_prompts_under_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 25)))
    scheduler.add_request(make_request("B", prompt(200, 7)))

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 10)]
    [new_a] = step.scheduler_output.scheduled_new_reqs
    assert (new_a.req_id, new_a.block_ids, new_a.num_computed_tokens) == ("A", [0, 1, 2], 0)
    assert step.runner_output.sampled_token_ids == {}  # a partial chunk samples nothing
    assert step.outputs == {}

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 10)]
    assert step.scheduler_output.scheduled_cached_reqs == [CachedRequestData("A", [3, 4], 10)]
    assert step.runner_output.sampled_token_ids == {}

    # A finishes its prompt (5) and B takes the 5 tokens left.
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 5), ("B", 5)]
    assert step.scheduler_output.scheduled_cached_reqs == [CachedRequestData("A", [5, 6], 20)]
    [new_b] = step.scheduler_output.scheduled_new_reqs
    assert (new_b.req_id, new_b.block_ids, new_b.num_computed_tokens) == ("B", [7, 8], 0)
    assert step.runner_output.sampled_token_ids == {"A": [T]}
    assert step.outputs["A"].new_token_ids == [T]

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 2)]
    assert step.runner_output.sampled_token_ids == {"A": [T + 1], "B": [T]}
    assert step.scheduler_output.total_num_scheduled_tokens == 3

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 1)]
    assert scheduler.requests["A"].output_token_ids == [T, T + 1, T + 2]
    assert scheduler.requests["B"].output_token_ids == [T, T + 1]


def test_long_prefill_token_threshold_caps_each_prefill_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=4)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 25)))
    scheduler.add_request(make_request("B", prompt(200, 7)))

    expected = [
        {"A": 4, "B": 4},
        {"A": 4, "B": 3},  # B's prompt done: first token
        {"A": 4, "B": 1},  # decodes still get 1
        {"A": 4, "B": 1},
        {"A": 4, "B": 1},
        {"A": 4, "B": 1},  # A has computed 24 of 25
        {"A": 1, "B": 1},  # A's prompt done: first token
        {"A": 1, "B": 1},
    ]
    sampled = []
    for expected_scheduled in expected:
        step = runner.step()
        assert list(step.scheduled.items()) == list(expected_scheduled.items())
        sampled.append(sorted(step.runner_output.sampled_token_ids))
    assert sampled == [[], ["B"], ["B"], ["B"], ["B"], ["B"], ["A", "B"], ["A", "B"]]
    assert scheduler.requests["A"].output_token_ids == [T, T + 1]
    assert scheduler.requests["B"].output_token_ids == [T + k for k in range(7)]


def test_running_requests_are_served_before_waiting_ones() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 6)))
    assert list(runner.step().scheduled.items()) == [("A", 6)]

    # A long prompt arrives: the decode of A is never starved by it.
    scheduler.add_request(make_request("B", prompt(200, 20)))
    assert list(runner.step().scheduled.items()) == [("A", 1), ("B", 7)]
    assert list(runner.step().scheduled.items()) == [("A", 1), ("B", 7)]
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 6)]
    assert step.runner_output.sampled_token_ids == {"A": [T + 3], "B": [T]}

    # Two decodes use the whole budget of 2: the waiting C gets nothing.
    scheduler.max_num_batched_tokens = 2
    scheduler.add_request(make_request("C", prompt(300, 3)))
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 1)]
    assert [request.request_id for request in scheduler.waiting] == ["C"]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 4), max_tokens=2))
    scheduler.add_request(make_request("B", prompt(200, 4), max_tokens=5))
    scheduler.add_request(make_request("C", prompt(300, 4)))

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 4), ("B", 4)]
    assert [request.request_id for request in scheduler.waiting] == ["C"]

    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 1)]
    assert step.outputs["A"].finish_reason == "length"
    assert [request.request_id for request in scheduler.running] == ["B"]

    step = runner.step()
    assert list(step.scheduled.items()) == [("B", 1), ("C", 4)]
    assert step.scheduler_output.finished_req_ids == {"A"}
    assert len(scheduler.running) == 2


def test_without_chunked_prefill_a_prompt_waits_for_enough_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=12, enable_chunked_prefill=False, max_model_len=12)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 6), max_tokens=2))
    scheduler.add_request(make_request("B", prompt(200, 9)))
    scheduler.add_request(make_request("C", prompt(300, 3)))

    # B (9) does not fit the 6 left, and C waits behind it (head of line).
    assert list(runner.step().scheduled.items()) == [("A", 6)]
    # 11 left after A's decode: B in one piece; the 2 left are too few for C.
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 9)]
    assert step.outputs["A"].finish_reason == "length"
    assert list(runner.step().scheduled.items()) == [("B", 1), ("C", 3)]


def test_without_chunked_prefill_the_long_prefill_threshold_never_splits_a_prompt() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=10, enable_chunked_prefill=False, long_prefill_token_threshold=4, max_model_len=10
    )
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 6)))
    assert list(runner.step().scheduled.items()) == [("A", 6)]


def test_without_chunked_prefill_the_budget_must_cover_max_model_len() -> None:
    # Else a preempted request's recompute (prompt + outputs) could exceed the
    # budget and never be scheduled again.
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=8 .*>= max_model_len \(256\)"):
        make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=256)


def test_without_chunked_prefill_a_preempted_request_resumes_in_one_piece() -> None:
    scheduler = make_scheduler(
        num_blocks=4, enable_caching=False, max_num_batched_tokens=12, enable_chunked_prefill=False, max_model_len=12
    )
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 4), max_tokens=6))
    scheduler.add_request(make_request("B", prompt(200, 4), max_tokens=8))
    for _ in range(5):
        runner.step()  # both decode until each holds 2 full blocks (8 tokens computed)
    step = runner.step()  # A needs a third block: B (the newest) is preempted
    assert step.scheduler_output.preempted_req_ids == {"B"}
    assert scheduler.requests["B"].num_tokens == 9
    b_chunks = []
    while scheduler.has_unfinished_requests():
        b_chunks.append(runner.step().scheduled.get("B"))
        assert len(b_chunks) < 30
    # B waits while A finishes, then recomputes its 9 tokens in one piece and
    # produces its 3 remaining tokens.
    assert [n for n in b_chunks if n is not None] == [9, 1, 1]
    assert scheduler.num_preemptions == 1


# ------------------------------------------------------------ policy order


@pytest.mark.parametrize(
    ("policy", "expected_steps"),
    [
        ("fcfs", [["A", "B"], ["C", "D"], ["E"]]),
        # (priority, arrival): E (0, 1.5) < B (0, 2.0) < D (0, 4.0) < C (1, 3.0) < A (2, 1.0)
        ("priority", [["E", "B"], ["D", "C"], ["A"]]),
    ],
)
def test_waiting_order_fcfs_vs_priority(policy: str, expected_steps: list[list[str]]) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=100, max_num_seqs=2, scheduling_policy=policy)
    runner = FakeRunner(scheduler)
    for request_id, priority, arrival_time in [
        ("A", 2, 1.0),
        ("B", 0, 2.0),
        ("C", 1, 3.0),
        ("D", 0, 4.0),
        ("E", 0, 1.5),  # added last, arrived early
    ]:
        scheduler.add_request(
            make_request(request_id, prompt(100 * ord(request_id), 4), max_tokens=1,
                         priority=priority, arrival_time=arrival_time)
        )
    expected_waiting = [request_id for ids in expected_steps for request_id in ids]
    assert [request.request_id for request in scheduler.waiting] == expected_waiting

    for expected_ids in expected_steps:
        step = runner.step()
        assert list(step.scheduled) == expected_ids
        assert [data.req_id for data in step.scheduler_output.scheduled_new_reqs] == expected_ids
        assert all(step.outputs[request_id].finish_reason == "length" for request_id in expected_ids)
    assert not scheduler.has_unfinished_requests()


# -------------------------------------------------------------- preemption


def test_preempted_request_keeps_its_outputs_and_is_recomputed_on_resume() -> None:
    # 5 blocks of 4; no prefix caching, so the resume recomputes everything.
    scheduler = make_scheduler(num_blocks=5, enable_caching=False, max_num_batched_tokens=100)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 7), max_tokens=4))
    scheduler.add_request(make_request("B", prompt(200, 7), max_tokens=4))

    assert list(runner.step().scheduled.items()) == [("A", 7), ("B", 7)]
    assert scheduler.kv_cache_manager.get_block_ids("A") == [0, 1]
    assert scheduler.kv_cache_manager.get_block_ids("B") == [2, 3]
    assert list(runner.step().scheduled.items()) == [("A", 1), ("B", 1)]  # 8 tokens: no new block
    scheduler.add_request(make_request("C", prompt(300, 4), max_tokens=2))

    # A takes the last block (4) for its 9th token; B needs one too and is the
    # newest running request, so it is the victim. No waiting request is
    # admitted in a step that had to preempt.
    step = runner.step()
    request_b = scheduler.requests["B"]
    assert list(step.scheduled.items()) == [("A", 1)]
    assert step.scheduler_output.preempted_req_ids == {"B"}
    assert step.scheduler_output.scheduled_cached_reqs == [CachedRequestData("A", [4], 8)]
    assert step.scheduler_output.scheduled_new_reqs == []
    assert request_b.status == RequestStatus.PREEMPTED
    assert request_b.num_computed_tokens == 0
    assert request_b.output_token_ids == [T, T + 1]
    assert request_b.all_token_ids == prompt(200, 7) + [T, T + 1]
    assert scheduler.kv_cache_manager.get_block_ids("B") == []
    assert free_block_ids(scheduler) == [3, 2]
    assert [request.request_id for request in scheduler.waiting] == ["B", "C"]
    assert scheduler.num_preemptions == 1 and request_b.num_preemptions == 1
    assert [request.request_id for request in scheduler.running] == ["A"]

    # B needs 3 blocks, 2 are free: it waits, and C waits behind it.
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1)]
    assert step.outputs["A"].finish_reason == "length"
    assert free_block_ids(scheduler) == [3, 2, 4, 1, 0]

    # B resumes: prompt + its 2 outputs recomputed in one piece on a fresh table.
    step = runner.step()
    assert step.scheduler_output.finished_req_ids == {"A"}
    assert list(step.scheduled.items()) == [("B", 9), ("C", 4)]
    assert step.scheduler_output.scheduled_cached_reqs == [
        CachedRequestData("B", [3, 2, 4], 0, resumed_from_preemption=True)
    ]
    [new_c] = step.scheduler_output.scheduled_new_reqs
    assert (new_c.req_id, new_c.block_ids) == ("C", [1])
    assert step.outputs["B"].new_token_ids == [T + 2]
    assert request_b.status == RequestStatus.RUNNING

    step = runner.step()
    assert list(step.scheduled.items()) == [("B", 1), ("C", 1)]
    assert step.outputs["B"].new_token_ids == [T + 3]
    assert step.outputs["B"].finish_reason == "length"
    assert request_b.output_token_ids == [T, T + 1, T + 2, T + 3]
    assert scheduler.num_preemptions == 1
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 5


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=5, enable_caching=True, max_num_batched_tokens=100)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 7), max_tokens=4))
    scheduler.add_request(make_request("B", prompt(200, 7), max_tokens=4))
    runner.step()
    runner.step()
    step = runner.step()
    assert step.scheduler_output.preempted_req_ids == {"B"}
    # B had computed 8 tokens = 2 full blocks: both freed but still cached.
    assert free_block_ids(scheduler) == [3, 2]

    # The hit blocks are themselves the free ones: nothing left for the 9th token.
    assert list(runner.step().scheduled.items()) == [("A", 1)]

    step = runner.step()  # A finished: free queue [3, 2, 4, 1, 0]
    assert list(step.scheduled.items()) == [("B", 1)]
    assert step.scheduler_output.scheduled_cached_reqs == [
        CachedRequestData("B", [2, 3, 4], 8, resumed_from_preemption=True)
    ]
    request_b = scheduler.requests["B"]
    assert request_b.num_cached_tokens == 0  # counted at the first scheduling only
    assert step.outputs["B"].new_token_ids == [T + 2]
    run_until_done(runner)
    assert request_b.output_token_ids == [T, T + 1, T + 2, T + 3]


@pytest.mark.parametrize(
    ("policy", "victim", "expected_scheduled", "expected_tables"),
    [
        # Newest running request.
        ("fcfs", "C", [("B", 1), ("A", 1)], {"B": [0, 1], "A": [2, 3, 5]}),
        # Largest priority value (B, although it runs first and arrived first);
        # its tokens scheduled earlier in this step go back to the budget.
        ("priority", "B", [("A", 1), ("C", 1)], {"A": [2, 3, 1], "C": [4, 5, 0]}),
    ],
)
def test_preemption_victim(
    policy: str, victim: str, expected_scheduled: list[tuple[str, int]], expected_tables: dict[str, list[int]]
) -> None:
    scheduler = make_scheduler(
        num_blocks=6, enable_caching=False, max_num_batched_tokens=100, scheduling_policy=policy
    )
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("B", prompt(200, 5), max_tokens=4, priority=2, arrival_time=1.0))
    assert list(runner.step().scheduled.items()) == [("B", 5)]
    scheduler.add_request(make_request("A", prompt(100, 8), max_tokens=4, priority=0, arrival_time=2.0))
    scheduler.add_request(make_request("C", prompt(300, 8), max_tokens=4, priority=1, arrival_time=3.0))
    assert list(runner.step().scheduled.items()) == [("B", 1), ("A", 8), ("C", 8)]
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # B (7 tokens) still fits its 2 blocks; A (9) needs a third: preempt.
    step = runner.step()
    assert list(step.scheduled.items()) == expected_scheduled
    assert step.scheduler_output.preempted_req_ids == {victim}
    assert [data.req_id for data in step.scheduler_output.scheduled_cached_reqs] == [
        request_id for request_id, _ in expected_scheduled
    ]
    for request_id, block_ids in expected_tables.items():
        assert scheduler.kv_cache_manager.get_block_ids(request_id) == block_ids
    victim_request = scheduler.requests[victim]
    assert victim_request.status == RequestStatus.PREEMPTED
    assert victim_request.num_computed_tokens == 0
    assert victim_request.output_token_ids == ([T, T + 1] if victim == "B" else [T])
    assert [request.request_id for request in scheduler.waiting] == [victim]
    assert scheduler.num_preemptions == 1

    requests = {request.request_id: request for request in scheduler.running + [victim_request]}
    run_until_done(runner)
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    for request in requests.values():
        assert request.output_token_ids == [T, T + 1, T + 2, T + 3]


# --------------------------------------------------------- stop conditions


@pytest.mark.parametrize(
    ("params", "script", "expected_tokens", "finish_reason", "stop_reason"),
    [
        pytest.param({"max_tokens": 10}, [10, 11, EOS, 12], [10, 11, EOS], "stop", None, id="eos"),
        pytest.param(
            {"max_tokens": 4, "ignore_eos": True}, [10, EOS, 11, 12, 13], [10, EOS, 11, 12], "length", None,
            id="ignore_eos",
        ),
        pytest.param(
            {"max_tokens": 10, "stop_token_ids": [42, 43]}, [10, 43, 42], [10, 43], "stop", 43, id="stop_token"
        ),
        pytest.param({"max_tokens": 3}, [10, 11, 12, 13], [10, 11, 12], "length", None, id="max_tokens"),
        pytest.param(
            {"max_tokens": 10, "min_tokens": 3, "stop_token_ids": [42]},
            [EOS, 42, 10, EOS, 11],
            [EOS, 42, 10, EOS],
            "stop",
            None,
            id="min_tokens_defers_eos_and_stop_tokens",
        ),
        pytest.param(
            {"max_tokens": 10, "min_tokens": 3, "stop_token_ids": [42]},
            [EOS, 42, 42, 10],
            [EOS, 42, 42],
            "stop",
            42,
            id="stop_token_at_min_tokens_stops",
        ),
        pytest.param(
            {"max_tokens": 2}, [10, EOS, 11], [10, EOS], "length", None, id="max_tokens_wins_over_eos"
        ),
    ],
)
def test_stop_conditions(
    params: dict[str, object],
    script: list[int],
    expected_tokens: list[int],
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    scheduler = make_scheduler(num_blocks=8)
    runner = FakeRunner(scheduler, scripts={"R": script})
    request = make_request("R", prompt(100, 5), **params)
    scheduler.add_request(request)

    streamed: list[int] = []
    for _ in range(len(expected_tokens)):
        step = runner.step()
        output = step.outputs["R"]
        streamed += output.new_token_ids
        if len(streamed) < len(expected_tokens):
            assert output.finish_reason is None and not output.finished
    assert streamed == expected_tokens
    assert request.output_token_ids == expected_tokens
    assert (output.finish_reason, output.stop_reason) == (finish_reason, stop_reason)
    assert (request.get_finished_reason(), request.stop_reason) == (finish_reason, stop_reason)
    assert scheduler.running == [] and "R" not in scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == 8

    step = runner.step()
    assert step.scheduler_output.finished_req_ids == {"R"}
    assert step.scheduler_output.is_empty


def test_max_model_len_stops_with_length() -> None:
    scheduler = make_scheduler(num_blocks=8, max_model_len=8)
    runner = FakeRunner(scheduler)
    request = make_request("R", prompt(100, 5), max_tokens=None, ignore_eos=True)
    scheduler.add_request(request)
    outputs = [runner.step().outputs["R"] for _ in range(3)]
    assert [output.finish_reason for output in outputs] == [None, None, "length"]
    assert request.output_token_ids == [T, T + 1, T + 2]
    assert request.num_tokens == 8
    assert not scheduler.has_unfinished_requests()


# ------------------------------------------------------------------- abort


def test_abort_running_and_waiting_requests_frees_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 7)))
    scheduler.add_request(make_request("B", prompt(200, 12)))
    scheduler.add_request(make_request("C", prompt(300, 4)))
    assert list(runner.step().scheduled.items()) == [("A", 7), ("B", 3)]
    assert scheduler.kv_cache_manager.get_block_ids("B") == [2]
    assert scheduler.kv_cache_manager.num_free_blocks == 5

    # B runs mid-prefill, C waits.
    aborted = scheduler.finish_requests(["B", "C"], RequestStatus.FINISHED_ABORTED)
    assert [request.request_id for request in aborted] == ["B", "C"]
    assert all(request.get_finished_reason() == "abort" for request in aborted)
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    assert [request.request_id for request in scheduler.running] == ["A"]
    assert len(scheduler.waiting) == 0
    runner.check_invariants()
    # Unknown and already finished ids are ignored.
    assert scheduler.finish_requests(["B", "nope"], RequestStatus.FINISHED_ABORTED) == []

    step = runner.step()
    assert step.scheduler_output.finished_req_ids == {"B", "C"}
    assert list(step.scheduled.items()) == [("A", 1)]

    [request_a] = scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    assert request_a.output_token_ids == [T, T + 1]
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()
    runner.check_invariants()
    step = runner.step()
    assert step.scheduler_output.finished_req_ids == {"A"}
    assert step.scheduler_output.is_empty
    assert runner.step().scheduler_output.finished_req_ids == set()


def test_abort_of_a_preempted_request_removes_it_from_waiting() -> None:
    scheduler = make_scheduler(num_blocks=5, enable_caching=False)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("A", prompt(100, 7)))
    scheduler.add_request(make_request("B", prompt(200, 7)))
    runner.step()
    runner.step()
    assert runner.step().scheduler_output.preempted_req_ids == {"B"}
    [request_b] = scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    assert request_b.status == RequestStatus.FINISHED_ABORTED
    assert len(scheduler.waiting) == 0
    scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 5
    assert runner.step().scheduler_output.finished_req_ids == {"A", "B"}


def test_output_of_a_request_aborted_mid_step_is_ignored() -> None:
    scheduler = make_scheduler(num_blocks=8)
    # A's second token is EOS: were it not ignored, the stop path would run
    # on a request that is no longer running.
    runner = FakeRunner(scheduler, scripts={"A": [10, EOS]})
    scheduler.add_request(make_request("A", prompt(100, 4)))
    scheduler.add_request(make_request("B", prompt(200, 4)))
    runner.step()

    scheduler_output = scheduler.schedule()
    assert list(scheduler_output.num_scheduled_tokens.items()) == [("A", 1), ("B", 1)]
    runner_output = runner.execute(scheduler_output)
    assert runner_output.sampled_token_ids == {"A": [EOS], "B": [T + 1]}
    [request_a] = scheduler.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    runner.check_invariants()

    assert [output.request_id for output in outputs] == ["B"]
    assert request_a.output_token_ids == [10]
    assert request_a.status == RequestStatus.FINISHED_ABORTED
    assert [request.request_id for request in scheduler.running] == ["B"]
    assert scheduler.kv_cache_manager.get_block_ids("B") == [1, 3]
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    step = runner.step()
    assert step.scheduler_output.finished_req_ids == {"A"}
    assert list(step.scheduled.items()) == [("B", 1)]


# ---------------------------------------------------------- prefix caching


def test_same_prompt_later_hits_the_prefix_cache_and_shares_blocks() -> None:
    scheduler = make_scheduler(num_blocks=16)
    runner = FakeRunner(scheduler)
    shared_prompt = prompt(100, 10)
    scheduler.add_request(make_request("A", shared_prompt))
    step = runner.step()
    assert scheduler.kv_cache_manager.get_block_ids("A") == [0, 1, 2]
    assert scheduler.requests["A"].num_cached_tokens == 0
    assert step.outputs["A"].num_cached_tokens == 0

    # 2 full blocks are hittable ((10 - 1) // 4); the partial third is not.
    scheduler.add_request(make_request("B", shared_prompt))
    step = runner.step()
    assert list(step.scheduled.items()) == [("A", 1), ("B", 2)]
    [new_b] = step.scheduler_output.scheduled_new_reqs
    assert (new_b.req_id, new_b.block_ids, new_b.num_computed_tokens) == ("B", [0, 1, 3], 8)
    request_b = scheduler.requests["B"]
    assert request_b.num_cached_tokens == 8
    assert step.outputs["B"].num_cached_tokens == 8
    assert step.outputs["B"].new_token_ids == [T]  # the 2 computed tokens end the prompt
    assert [block.ref_cnt for block in scheduler.kv_cache_manager.block_pool.blocks[:4]] == [2, 2, 1, 1]

    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
