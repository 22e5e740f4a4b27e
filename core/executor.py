"""What the engine core asks of whatever runs the model.

The core decides what to run (the scheduler's `SchedulerOutput`) and hands it
to a model executor: an `executors.base.Executor` (the executor plugin kind:
`uni` runs one in-process Worker's `ModelRunner`) or, in tests, a fake.
The core names none of them: it holds this Protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelExecutor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the scheduled tokens of every request, then sample
        (and verify / propose drafts); the sampled tokens come back."""
        ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step and return at once (async scheduling); steps run
        one at a time, in the order they were started."""
        ...
