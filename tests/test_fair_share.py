"""Fair sharing of the running seats between API requests (core/fair_share.py).

Hand-computed schedules on the real Scheduler and KVCacheManager driven by the
FakeRunner (tests/helpers/scheduler_utils.py): block_size 4, every prompt 4
tokens, so a prefill is one step and each sequence samples one token a step.
A "big" request is one group of many sequences (its prompts x n samples), as
the front end sends it (`group_id`); a small request is its own group.
"""

from __future__ import annotations

from helpers.scheduler_utils import DEFAULT_TOKEN_BASE, FakeRunner, make_request, make_scheduler, prompt

from pagedllm.core.fair_share import FairShare
from pagedllm.core.request import RequestStatus

T = DEFAULT_TOKEN_BASE


def add_big_request(scheduler, num_sequences: int, *, priority: int = 0, max_tokens: int = 20) -> list[str]:
    ids = [f"b{index}" for index in range(num_sequences)]
    for index, request_id in enumerate(ids):
        scheduler.add_request(make_request(
            request_id, prompt(100 + 10 * index, 4), group_id="big", priority=priority,
            max_tokens=max_tokens, ignore_eos=True,
        ))
    return ids


def test_small_request_gets_a_seat_from_a_request_holding_every_seat() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    add_big_request(scheduler, 6)
    # Alone, the big request takes every seat (fair sharing is work-conserving).
    assert runner.step().scheduled == {"b0": 4, "b1": 4, "b2": 4, "b3": 4}
    assert runner.step().scheduled == {"b0": 1, "b1": 1, "b2": 1, "b3": 1}

    scheduler.add_request(make_request("small", prompt(500, 4), max_tokens=2, ignore_eos=True))
    # Two groups: a share of 4 // 2 = 2 seats. The big one holds 4, so its
    # newest sequence (b3) is preempted and the small request takes its seat
    # in the same step; b3, b4 and b5 step aside for it.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "small": 4}
    assert step.scheduler_output.preempted_req_ids == {"b3"}
    assert [request.request_id for request in scheduler.waiting] == ["b3", "b4", "b5"]
    assert scheduler.requests["b3"].status == RequestStatus.PREEMPTED

    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "small": 1}
    assert step.outputs["small"].finish_reason == "length"
    assert step.outputs["small"].new_token_ids == [T + 1]

    # The small request's seat goes back: b3 resumes; its prompt's full block
    # is a prefix-cache hit, so it recomputes only its two tokens.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "b3": 2}
    assert step.runner_output.sampled_token_ids["b3"] == [T + 2]
    assert scheduler.num_preemptions == 1
    # Run to the end: no other preemption, and the group counts are gone.
    while scheduler.has_unfinished_requests():
        runner.step()
    assert scheduler.num_preemptions == 1
    assert (scheduler._group_sizes, scheduler._num_multi_sequence_groups) == ({}, 0)


def test_without_fair_share_the_small_request_waits_for_a_free_seat() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, fair_share=False)
    runner = FakeRunner(scheduler)
    add_big_request(scheduler, 6, max_tokens=5)
    runner.step()
    runner.step()
    scheduler.add_request(make_request("small", prompt(500, 4), max_tokens=2, ignore_eos=True))
    # FCFS: the big request's 4 running sequences finish (5 tokens) first;
    # then its waiting b4 and b5 come before the small request too.
    for _ in range(3):
        assert runner.step().scheduled == {"b0": 1, "b1": 1, "b2": 1, "b3": 1}
    assert runner.step().scheduled == {"b4": 4, "b5": 4, "small": 4}
    assert scheduler.num_preemptions == 0


def test_waiting_sequences_of_a_group_at_its_share_step_aside() -> None:
    # Free seats, no preemption needed: the big request's waiting sequences
    # come first in the queue, but it already holds its share (2 of 4).
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("other", prompt(400, 4), max_tokens=1, ignore_eos=True))
    add_big_request(scheduler, 5, max_tokens=3)
    # Groups "other" and "big": the share is 2, but "other" has only one
    # sequence, so "big" takes the other 3 seats (nobody starves).
    assert runner.step().scheduled == {"other": 4, "b0": 4, "b1": 4, "b2": 4}
    scheduler.add_request(make_request("small", prompt(500, 4), max_tokens=2, ignore_eos=True))
    # "other" finished: one seat is free. Groups "big" (3 running) and
    # "small": b3 steps aside, the small request is admitted; nobody is preempted.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "small": 4}
    assert step.scheduler_output.preempted_req_ids == set()


def test_a_starved_group_of_many_sequences_gains_a_seat_a_step_up_to_its_share() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    add_big_request(scheduler, 4)
    runner.step()
    for index in range(3):
        scheduler.add_request(make_request(
            f"s{index}", prompt(500 + 10 * index, 4), group_id="second", max_tokens=20, ignore_eos=True,
        ))
    # Share 2 each: one preemption a step until "big" is down to its share.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "s0": 4}
    assert step.scheduler_output.preempted_req_ids == {"b3"}
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "s0": 1, "s1": 4}
    assert step.scheduler_output.preempted_req_ids == {"b2"}
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "s0": 1, "s1": 1}
    assert step.scheduler_output.preempted_req_ids == set()
    assert scheduler.num_preemptions == 2


def test_priority_policy_a_worse_priority_request_takes_no_seat() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority")
    runner = FakeRunner(scheduler)
    add_big_request(scheduler, 4, priority=0)
    runner.step()
    scheduler.add_request(make_request("low", prompt(500, 4), priority=5, max_tokens=2, ignore_eos=True))
    scheduler.add_request(make_request("high", prompt(600, 4), priority=-1, max_tokens=2, ignore_eos=True))
    # "high" (better priority) takes a seat from "big"; "low" waits, as priority says.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "high": 4}
    assert step.scheduler_output.preempted_req_ids == {"b3"}
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "b2": 1, "high": 1}
    assert step.scheduler_output.preempted_req_ids == set()
    assert scheduler.requests["low"].status == RequestStatus.WAITING


def test_memory_preemption_takes_from_the_largest_group_not_the_newest_request() -> None:
    # 7 blocks of 4 tokens: a sequence needs its second block for its 5th token.
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=7, enable_caching=False)
    runner = FakeRunner(scheduler)
    add_big_request(scheduler, 3)
    runner.step()
    scheduler.add_request(make_request("small", prompt(500, 4), max_tokens=20, ignore_eos=True))
    assert runner.step().scheduled == {"b0": 1, "b1": 1, "b2": 1, "small": 4}
    # The b's took their second blocks: all 7 are used. Now "small" needs its
    # second: plain FCFS would preempt "small" (the newest), fair sharing takes b2.
    step = runner.step()
    assert step.scheduled == {"b0": 1, "b1": 1, "small": 1}
    assert step.scheduler_output.preempted_req_ids == {"b2"}


def test_share_is_seats_over_groups_ready_to_run() -> None:
    scheduler = make_scheduler(max_num_seqs=8)
    for request_id, group_id in [("a", "g1"), ("b", "g1"), ("c", "g2"), ("d", "g3")]:
        scheduler.add_request(make_request(request_id, prompt(100, 4), group_id=group_id))
    fair = FairShare(scheduler.running, scheduler.requests.values(), scheduler.max_num_seqs, by_priority=False)
    assert fair.share == 8 // 3
    assert fair.starved == {"g1", "g2", "g3"}
