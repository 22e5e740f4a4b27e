"""EngineCore on its own: it receives its parts, so stand-ins for the
scheduler, the model executor and the grammar manager show what step() and
the idle wait do, without a model."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.engine import GRAMMAR_WAIT_S, EngineCore, StepResult
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class FakeScheduler:
    """Schedules `num_tokens` tokens each step and reports `outputs`."""

    def __init__(
        self, calls: list[str], num_tokens: int, outputs: list[EngineCoreOutput], *, async_scheduling: bool = False
    ) -> None:
        self.calls = calls
        self.num_tokens = num_tokens
        self.outputs = outputs
        self.scheduled: list[SchedulerOutput] = []
        self.kv_connector = None
        self.lora_slots = None
        self.async_scheduling = async_scheduling
        # The steps scheduled from now on need their outputs processed first.
        self.sync_required = False
        self.num_unfinished = 1

    def schedule(self) -> SchedulerOutput:
        self.calls.append(f"schedule {len(self.scheduled) + 1}")
        num_scheduled = {"r": self.num_tokens} if self.num_tokens else {}
        scheduler_output = SchedulerOutput([], [], num_scheduled, self.num_tokens, sync_required=self.sync_required)
        self.scheduled.append(scheduler_output)
        return scheduler_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        step = next(i for i, scheduled in enumerate(self.scheduled, 1) if scheduled is scheduler_output)
        self.calls.append(f"update {step} {runner_output.sampled_token_ids}")
        return self.outputs

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0


class FakeExecutor:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.calls.append(f"execute {scheduler_output.total_num_scheduled_tokens}")
        return ModelRunnerOutput(sampled_token_ids={req_id: [7] for req_id in scheduler_output.num_scheduled_tokens})

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Launched, not yet run: it runs when its result is asked for."""
        self.calls.append(f"launch {scheduler_output.total_num_scheduled_tokens}")
        future: Future[ModelRunnerOutput] = Future()
        sampled = {"r": [7]} if scheduler_output.num_scheduled_tokens else {}
        future.set_result(ModelRunnerOutput(sampled_token_ids=sampled))
        return future


class FakeGrammarManager:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait_for_compiles(self, timeout_s: float) -> None:
        self.calls.append(f"wait {timeout_s}")


def _core(
    num_tokens: int, outputs: list[EngineCoreOutput], *, with_grammars: bool = True, async_scheduling: bool = False
) -> tuple[EngineCore, list[str]]:
    calls: list[str] = []
    scheduler: Any = FakeScheduler(calls, num_tokens, outputs, async_scheduling=async_scheduling)
    core = EngineCore(
        EngineConfig.load(),
        scheduler=scheduler,
        kv_cache_manager=object(),  # type: ignore[arg-type]  # step() never touches it
        model_executor=FakeExecutor(calls),
        structured_output_manager=FakeGrammarManager(calls) if with_grammars else None,  # type: ignore[arg-type]
        max_model_len=64,
        vocab_size=100,
    )
    return core, calls


def test_step_is_schedule_execute_update() -> None:
    output = EngineCoreOutput(request_id="r", new_token_ids=[7])
    core, calls = _core(3, [output])
    assert core.step() == StepResult([output], num_scheduled_tokens=3, made_progress=True)
    assert calls == ["schedule 1", "execute 3", "update 1 {'r': [7]}"]


@pytest.mark.parametrize(
    ("num_tokens", "num_outputs", "waits"),
    [
        (0, 0, True),  # nothing ran, nothing finished: only grammars compiling
        (0, 1, False),  # a request finished (e.g. its grammar failed)
        (3, 0, False),  # a prefill chunk ran
        (3, 1, False),
    ],
)
def test_a_step_says_whether_it_made_progress_and_never_waits_itself(
    num_tokens: int, num_outputs: int, waits: bool
) -> None:
    finished = EngineCoreOutput(request_id="r", new_token_ids=[], finish_reason="abort")
    core, calls = _core(num_tokens, [finished] * num_outputs)
    result = core.step()
    assert "wait" not in " ".join(calls)  # step() itself never waits
    assert result.made_progress is not waits
    assert result.num_scheduled_tokens == num_tokens
    del calls[:]
    core.wait_for_work()  # what the loop calls after a step without progress
    assert calls == [f"wait {GRAMMAR_WAIT_S}"]


def test_without_a_grammar_manager_the_idle_loop_returns_at_once() -> None:
    core, calls = _core(0, [], with_grammars=False)
    core.step()
    del calls[:]
    core.wait_for_work(5.0)
    assert calls == []


# ------------------------------------------------------- async scheduling


def test_async_scheduling_launches_the_next_step_before_processing_the_last() -> None:
    output = EngineCoreOutput(request_id="r", new_token_ids=[7])
    core, calls = _core(3, [output], async_scheduling=True)
    assert core.step() == StepResult([], 0, made_progress=True)  # the first step only launches
    assert calls == ["schedule 1", "launch 3"]
    assert core.step().outputs == [output]
    assert calls[2:] == ["schedule 2", "launch 3", "update 1 {'r': [7]}"]
    assert core.step().outputs == [output]
    assert calls[5:] == ["schedule 3", "launch 3", "update 2 {'r': [7]}"]
    assert "execute" not in " ".join(calls)


def test_a_step_that_only_launches_reports_no_tokens_of_an_earlier_step() -> None:
    """A pipeline's first step after an idle spell computed nothing yet: the
    tokens of the step processed before the spell are not counted again."""
    output = EngineCoreOutput(request_id="r", new_token_ids=[7])
    core, _ = _core(3, [output], async_scheduling=True)
    core.step()
    core.scheduler.num_unfinished = 0  # type: ignore[attr-defined]
    assert core.step() == StepResult([output], 3, made_progress=True)  # step 1 processed
    assert not core.has_unfinished_requests()
    core.scheduler.num_unfinished = 1  # type: ignore[attr-defined]  # a new request
    assert core.step() == StepResult([], 0, made_progress=True)  # step 2 only launched


def test_a_step_in_flight_keeps_the_engine_stepping_until_its_outputs_are_processed() -> None:
    output = EngineCoreOutput(request_id="r", new_token_ids=[7])
    core, calls = _core(3, [output], async_scheduling=True)
    core.step()
    core.scheduler.num_unfinished = 0  # type: ignore[attr-defined]  # e.g. aborted meanwhile
    assert core.has_unfinished_requests()
    assert core.step().outputs == [output]
    assert calls[2:] == ["update 1 {'r': [7]}"]  # nothing new is scheduled
    assert not core.has_unfinished_requests()


def test_a_step_that_needs_its_outputs_first_is_processed_before_the_next_schedule() -> None:
    output = EngineCoreOutput(request_id="r", new_token_ids=[7])
    core, calls = _core(3, [output], async_scheduling=True)
    core.step()
    core.scheduler.sync_required = True  # type: ignore[attr-defined]  # e.g. a grammar request samples
    assert core.step().outputs == [output]  # step 2 (sync) launched, step 1 processed
    assert core.step().outputs == [output]  # step 2 processed before step 3 is scheduled
    assert core.step().outputs == [output]  # step 3 launched and processed at once
    assert calls[2:] == [
        "schedule 2", "launch 3", "update 1 {'r': [7]}",
        "update 2 {'r': [7]}",
        "schedule 3", "launch 3", "update 3 {'r': [7]}",
    ]


def test_async_scheduling_processes_an_empty_schedule_at_once_when_nothing_is_in_flight() -> None:
    core, calls = _core(0, [], async_scheduling=True)
    assert core.step() == StepResult([], 0, made_progress=False)  # only grammars compiling: the loop may wait
    assert calls == ["schedule 1", "launch 0", "update 1 {}"]
