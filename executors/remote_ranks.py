"""What the `mp` and `ray` executors share: ranks outside the engine's
process, driven by the frames of executors/messages.py.

The facts an executor reports (platform, model facts, attention backend) are
decided from the config alone (`plan_ranks`), so no rank is asked for them.
With a KV connector every rank answers each step and the ranks' connector
reports are merged (the connector's scheduler side is the builder's).
Once a rank fails, the executor has failed for good: `_fail` keeps the first
`RankFailedError` and every later call raises it at once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.core.custom_stats import merge_figures
from pagedllm.executors.base import Executor, RankFailedError
from pagedllm.executors.kv_output_aggregator import KVOutputAggregator
from pagedllm.executors.worker_host import OUTPUT_RANK
from pagedllm.plugins import get_plugin_manager
from pagedllm.worker.worker import plan_ranks

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.selector import BackendSelection
    from pagedllm.core.scheduler_output import ModelRunnerOutput
    from pagedllm.platforms.interface import Platform
    from pagedllm.worker.model_facts import ModelFacts

logger = logging.getLogger(__name__)


class RemoteRanksExecutor(Executor):
    """A subclass calls `_plan_ranks()` first in its `_init_executor`."""

    def _plan_ranks(self) -> None:
        self.world_size = self.config.parallel.tensor_parallel_size
        self._platform, self._model_facts, self._attn_selection = plan_ranks(self.config, get_plugin_manager())
        self._failure: RankFailedError | None = None
        # With a KV connector every rank reports what its worker side
        # finished, loaded and saved; a step waits for all of them.
        with_connector = self.config.kv_transfer.connector is not None
        self._kv_outputs = KVOutputAggregator(self.world_size) if with_connector else None
        self._step_ranks = set(range(self.world_size)) if with_connector else {OUTPUT_RANK}

    def _fail(self, error: RankFailedError) -> RankFailedError:
        """Record the executor's first failure and return it (to raise)."""
        if self._failure is None:
            logger.error("%s executor: %s", type(self).__name__, error)
            self._failure = error
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _step_output(self, outputs: dict[int, ModelRunnerOutput | None]) -> ModelRunnerOutput:
        """Rank 0's step output, with the ranks' KV connector reports merged
        (a reply without an output fails the executor)."""
        answers: dict[int, ModelRunnerOutput] = {}
        for rank in sorted(self._step_ranks):
            answer = outputs.get(rank)
            if answer is None:
                raise self._fail(RankFailedError(rank, "answered a step without its output"))
            answers[rank] = answer
        output = answers[OUTPUT_RANK]
        figures = [answer.custom_stats for answer in answers.values()]
        output.custom_stats = None
        for rank_figures in figures:  # each rank's own figures (rank 0's drafter, every rank's connector)
            if rank_figures:
                output.custom_stats = merge_figures(output.custom_stats or {}, rank_figures)
        if self._kv_outputs is not None:
            output.kv_connector_output = self._kv_outputs.merge(
                answer.kv_connector_output for answer in answers.values()
            )
        return output

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
