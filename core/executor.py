"""What the engine core asks of whatever runs the model.

The core decides what to run (the scheduler's `SchedulerOutput`) and hands it
to a model executor; the worker layer's `ModelRunner` is one, and an executor
plugin kind (one process, many ranks) will offer others. The core names none
of them: it holds this Protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelExecutor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the scheduled tokens of every request, then sample
        (and verify / propose drafts); the sampled tokens come back."""
        ...
