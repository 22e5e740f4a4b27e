"""The scheduler under async scheduling: step k + 1 is scheduled before step
k's sampled tokens are known (placeholders), and step k's outputs arrive after.

`FakeRunner.run_async` serializes the engine's order (schedule k + 1, update
k, run k + 1) and checks on every step that the runner's tokens and block
tables agree with the scheduler's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from tests.helpers.scheduler_utils import EOS, FakeRunner, make_request, make_scheduler, prompt


def _outputs(results: list[Any], request_id: str) -> tuple[list[int], str | None]:
    """A request's tokens as reported by the processed steps, and its finish reason."""
    token_ids: list[int] = []
    finish_reason = None
    for result in results:
        output = result.outputs.get(request_id)
        if output is not None:
            token_ids.extend(output.new_token_ids)
            finish_reason = output.finish_reason or finish_reason
    return token_ids, finish_reason


def test_a_decoding_request_is_scheduled_again_before_its_token_is_known() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeRunner(scheduler)
    request = make_request("r", prompt(10, 4), max_tokens=3)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert (first.num_scheduled_tokens, request.num_output_placeholders) == ({"r": 4}, 1)
    first_output = runner.execute(first)
    second = scheduler.schedule()  # step 1's token is not known here yet
    assert (second.num_scheduled_tokens, request.num_output_placeholders) == ({"r": 1}, 2)
    assert (request.num_tokens, request.num_computed_tokens) == (4, 5)
    outputs = scheduler.update_from_output(first, first_output)
    assert [o.new_token_ids for o in outputs] == [[1000]]
    assert (request.num_output_placeholders, request.num_tokens) == (1, 5)


def test_max_tokens_is_never_overshot_by_steps_in_flight() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("r", prompt(10, 4), max_tokens=3))
    results = runner.run_async()
    # The 4th schedule sees 2 tokens known and 1 in flight: max_tokens is reached.
    assert [r.scheduled for r in results] == [{"r": 4}, {"r": 1}, {"r": 1}, {}]
    assert _outputs(results, "r") == ([1000, 1001, 1002], "length")


def test_eos_in_flight_drops_the_step_scheduled_behind_it() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeRunner(scheduler, scripts={"r": [1000, EOS, 1002, 1003]})
    scheduler.add_request(make_request("r", prompt(10, 4), max_tokens=10))
    results = runner.run_async()
    # Step 3 was scheduled before step 2's EOS was seen; its token is dropped.
    assert [r.scheduled for r in results] == [{"r": 4}, {"r": 1}, {"r": 1}]
    assert _outputs(results, "r") == ([1000, EOS], "stop")
    assert scheduler.kv_cache_manager.usage == 0
    assert scheduler.schedule().finished_req_ids == {"r"}  # the runner forgets it next step


def _r2_preempted_with_a_step_in_flight(r2_max_tokens: int) -> tuple[Scheduler, list[Any]]:
    """4 blocks of 4 tokens: two 4-token prompts take two blocks each by
    position 7; r1's position 8 needs a fifth, so at the 6th step the newest
    (r2) is preempted while its 5th token is in flight."""
    scheduler = make_scheduler(async_scheduling=True, num_blocks=4)
    scheduler.add_request(make_request("r1", prompt(10, 4), max_tokens=8))
    scheduler.add_request(make_request("r2", prompt(20, 4), max_tokens=r2_max_tokens))
    return scheduler, FakeRunner(scheduler).run_async()


def test_a_request_preempted_with_its_last_token_in_flight_finishes_from_the_waiting_queue() -> None:
    scheduler, results = _r2_preempted_with_a_step_in_flight(r2_max_tokens=5)  # the 5th is its last
    preempting = [i for i, r in enumerate(results) if r.scheduler_output.preempted_req_ids]
    assert preempting == [5]
    assert results[5].scheduled == {"r1": 1}
    assert "r2" in results[4].runner_output.sampled_token_ids  # its step was in flight
    assert _outputs(results, "r2") == ([1000, 1001, 1002, 1003, 1004], "length")
    assert _outputs(results, "r1") == ([1000 + i for i in range(8)], "length")
    assert scheduler.get_num_unfinished_requests() == 0


def test_a_preempted_request_keeps_the_token_its_step_in_flight_sampled() -> None:
    # r2 resumes after r1 and recomputes its prompt plus every output, the
    # in-flight one included (the runner checks its tokens against the
    # scheduler's on every step).
    _, results = _r2_preempted_with_a_step_in_flight(r2_max_tokens=9)
    assert results[5].scheduler_output.preempted_req_ids == {"r2"}
    assert "r2" in results[4].runner_output.sampled_token_ids
    resumed = next(r for r in results[6:] if "r2" in r.scheduled)
    # Prompt + the 5 outputs known by then, less its prompt block (a prefix hit).
    assert resumed.scheduled["r2"] == 4 + 5 - 4
    assert _outputs(results, "r2") == ([1000 + i for i in range(9)], "length")


def test_async_and_sync_scheduling_report_the_same_tokens() -> None:
    def run(async_scheduling: bool) -> list[tuple[list[int], str | None]]:
        scheduler = make_scheduler(async_scheduling=async_scheduling, num_blocks=12, max_num_batched_tokens=10)
        runner = FakeRunner(scheduler, scripts={"b": [1000 + i if i != 6 else EOS for i in range(20)]})
        for index, request_id in enumerate("abcde"):
            scheduler.add_request(make_request(request_id, prompt(100 * index, 5 + 3 * index), max_tokens=9 + index))
        if async_scheduling:
            results = runner.run_async()
        else:
            results = []
            while scheduler.has_unfinished_requests():
                results.append(runner.step())
        return [_outputs(results, request_id) for request_id in "abcde"]

    assert run(True) == run(False)


def test_a_grammar_request_waits_for_its_token_in_flight() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    runner = FakeRunner(scheduler)
    request = make_request("r", prompt(10, 4), max_tokens=5)
    scheduler.add_request(request)
    runner.execute(scheduler.schedule())
    request.structured_output_request = object()  # type: ignore[assignment]  # its bitmask needs the token
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_a_kv_connector_turns_async_scheduling_off_drafts_do_not() -> None:
    config = SchedulerConfig(async_scheduling=True)
    manager = KVCacheManager(16, 4)
    assert Scheduler(config, manager, 64).async_scheduling
    assert Scheduler(config, manager, 64, num_spec_tokens=2).async_scheduling
    connector = SimpleNamespace(wants_eviction_events=False)
    assert not Scheduler(config, manager, 64, kv_connector=connector).async_scheduling  # type: ignore[arg-type]
    assert not Scheduler(SchedulerConfig(), manager, 64).async_scheduling


def test_a_request_scheduled_ahead_gets_draft_placeholders_and_its_rejections_are_undone() -> None:
    scheduler = Scheduler(
        SchedulerConfig(async_scheduling=True), KVCacheManager(64, 4, debug_checks=True), 256, num_spec_tokens=3
    )
    request = make_request("r", prompt(10, 4), max_tokens=20)
    scheduler.add_request(request)
    first = scheduler.schedule()
    first_output = ModelRunnerOutput({"r": [1000]}, spec_token_ids={"r": [1001, 1002, 1003]})
    # Step 1's token and drafts are not known here: 1 + k slots, k placeholders.
    second = scheduler.schedule()
    assert (second.num_scheduled_tokens, second.scheduled_spec_decode_tokens) == ({"r": 4}, {"r": [-1, -1, -1]})
    cached = second.scheduled_cached_reqs[0]
    assert (cached.num_computed_tokens, cached.num_output_placeholders) == (4, 1)  # the runner corrects 4
    assert (request.num_computed_tokens, request.num_output_placeholders) == (8, 5)
    scheduler.update_from_output(first, first_output)
    # The runner verified 2 drafts in the 3 placeholders' place and accepted 1.
    second_output = ModelRunnerOutput({"r": [1001, 1005]}, num_placeholder_drafts={"r": 2})
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"r": 4} and third.scheduled_cached_reqs[0].num_computed_tokens == 8
    scheduler.update_from_output(second, second_output)
    # 7 tokens known, 6 computed for real, and step 3's 1 + 3 in flight.
    assert (request.num_tokens, request.num_computed_tokens, request.num_output_placeholders) == (7, 10, 4)
    stats = scheduler.total_spec_decoding_stats
    assert stats is not None and (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)
    assert (request.spec_num_drafts, request.spec_num_draft_tokens, request.spec_num_accepted_tokens) == (1, 2, 1)


def test_placeholders_stop_short_of_max_tokens_counting_every_draft_in_flight_as_accepted() -> None:
    scheduler = Scheduler(SchedulerConfig(async_scheduling=True), KVCacheManager(64, 4), 256, num_spec_tokens=3)
    scheduler.add_request(make_request("r", prompt(10, 4), max_tokens=4))
    scheduler.schedule()
    # 1 token in flight: at most 4 - 1 - 1 = 2 drafts before the last token.
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"r": [-1, -1]}
    # 1 + 1 + 2 in flight: the 4 tokens it may have; it waits.
    assert scheduler.schedule().num_scheduled_tokens == {}
