"""`uni`: one Worker in the engine's own process (one rank, no collectives)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.executors.base import Executor
from pagedllm.worker.worker import Worker

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.platforms.interface import Platform
    from pagedllm.worker.model_facts import ModelFacts


class UniProcExecutor(Executor):
    """vLLM's `UniProcExecutor`: the driver worker is rank 0 and the only rank."""

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0, local_rank=0, distributed_init_method=None)
        self.driver_worker.load_model()

    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # NOTE: called every step: straight to the worker, no RPC indirection.
        return self.driver_worker.execute_model(scheduler_output)

    def _init_step_thread(self) -> None:
        # The current CUDA device is per thread; the worker set it on this one.
        device = self.driver_worker.device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)

    @property
    def model_facts(self) -> ModelFacts:
        return self.driver_worker.model_facts

    @property
    def attn_selection(self) -> BackendSelection:
        return self.driver_worker.attn_selection

    @property
    def platform(self) -> Platform:
        return self.driver_worker.platform

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device
