"""What the `mp` and `ray` executors share: ranks outside the engine's
process, driven by the frames of executors/messages.py.

The facts an executor reports (platform, model facts, attention backend) are
decided from the config alone (`plan_ranks`), so no rank is asked for them.
Once a rank fails, the executor has failed for good: `_fail` keeps the first
`RankFailedError` and every later call raises it at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.executors.base import Executor, RankFailedError
from pagedllm.executors.messages import runner_output_from_wire
from pagedllm.executors.worker_host import OUTPUT_RANK
from pagedllm.plugins import get_plugin_manager
from pagedllm.worker.worker import plan_ranks

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.scheduler_output import ModelRunnerOutput
    from pagedllm.executors.messages import RunnerOutputWire
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.platforms.interface import Platform
    from pagedllm.worker.model_facts import ModelFacts

logger = logging.getLogger(__name__)


class RemoteRanksExecutor(Executor):
    """A subclass calls `_plan_ranks()` first in its `_init_executor`."""

    def _plan_ranks(self) -> None:
        self.world_size = self.config.parallel.tensor_parallel_size
        self._platform, self._model_facts, self._attn_selection = plan_ranks(self.config, get_plugin_manager())
        self._failure: RankFailedError | None = None

    def _fail(self, error: RankFailedError) -> RankFailedError:
        """Record the executor's first failure and return it (to raise)."""
        if self._failure is None:
            logger.error("%s executor: %s", type(self).__name__, error)
            self._failure = error
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _step_output(self, output: RunnerOutputWire | None) -> ModelRunnerOutput:
        """Rank 0's step output from its reply (a reply without one fails the executor)."""
        if output is None:
            raise self._fail(RankFailedError(OUTPUT_RANK, "answered a step without its output"))
        return runner_output_from_wire(output)

    # -------------------------------------------------------------- facts

    @property
    def model_facts(self) -> ModelFacts:
        return self._model_facts

    @property
    def attn_selection(self) -> BackendSelection:
        return self._attn_selection

    @property
    def platform(self) -> Platform:
        return self._platform

    @property
    def device(self) -> torch.device:
        return self._platform.device()

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        # KV connectors run at tensor_parallel_size 1 for now (plan_ranks refuses them above).
        return None
