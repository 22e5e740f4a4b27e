"""EngineCore on its own: it receives its parts, so stand-ins for the
scheduler, the model executor and the grammar manager show what step() and
the idle wait do, without a model."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.engine import GRAMMAR_WAIT_S, EngineCore
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class FakeScheduler:
    """Schedules `num_tokens` tokens each step and reports `outputs`."""

    def __init__(self, calls: list[str], num_tokens: int, outputs: list[EngineCoreOutput]) -> None:
        self.calls = calls
        self.num_tokens = num_tokens
        self.outputs = outputs
        self.scheduler_output: SchedulerOutput | None = None
        self.kv_connector = None

    def schedule(self) -> SchedulerOutput:
        self.calls.append("schedule")
        num_scheduled = {"r": self.num_tokens} if self.num_tokens else {}
        self.scheduler_output = SchedulerOutput([], [], num_scheduled, self.num_tokens)
        return self.scheduler_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        assert scheduler_output is self.scheduler_output
        self.calls.append(f"update {runner_output.sampled_token_ids}")
        return self.outputs


class FakeExecutor:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.calls.append(f"execute {scheduler_output.total_num_scheduled_tokens}")
        return ModelRunnerOutput(sampled_token_ids={req_id: [7] for req_id in scheduler_output.num_scheduled_tokens})


class FakeGrammarManager:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait_for_compiles(self, timeout_s: float) -> None:
        self.calls.append(f"wait {timeout_s}")


def _core(
    num_tokens: int, outputs: list[EngineCoreOutput], *, with_grammars: bool = True
) -> tuple[EngineCore, list[str]]:
    calls: list[str] = []
    scheduler: Any = FakeScheduler(calls, num_tokens, outputs)
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
    assert core.step() == [output]
    assert calls == ["schedule", "execute 3", "update {'r': [7]}"]
    assert core.num_scheduled_tokens == 3


@pytest.mark.parametrize(
    ("num_tokens", "num_outputs", "waits"),
    [
        (0, 0, True),  # nothing ran, nothing finished: only grammars compiling
        (0, 1, False),  # a request finished (e.g. its grammar failed)
        (3, 0, False),  # a prefill chunk ran
        (3, 1, False),
    ],
)
def test_the_loop_waits_for_grammars_only_after_a_step_without_progress(
    num_tokens: int, num_outputs: int, waits: bool
) -> None:
    finished = EngineCoreOutput(request_id="r", new_token_ids=[], finish_reason="abort")
    core, calls = _core(num_tokens, [finished] * num_outputs)
    core.wait_for_work()  # before any step: nothing to wait for
    core.step()
    assert "wait" not in " ".join(calls)  # step() itself never waits
    del calls[:]
    core.wait_for_work()
    assert calls == ([f"wait {GRAMMAR_WAIT_S}"] if waits else [])


def test_without_a_grammar_manager_the_idle_loop_returns_at_once() -> None:
    core, calls = _core(0, [], with_grammars=False)
    core.step()
    del calls[:]
    core.wait_for_work(5.0)
    assert calls == []
