"""EngineCore: add and abort requests, and step: schedule -> execute -> update.

With async scheduling (vLLM's batch queue) a step schedules and launches the
next batch before it processes the previous batch's outputs, so scheduling,
output processing and the API's I/O overlap the forward in flight.

It receives its parts (scheduler, KV cache manager, model executor, grammar
manager) from the builder (engine/builder.py), which alone turns a config into
platform, attention backend, model, drafter and KV connector; this module
names none of them.
"""

from __future__ import annotations

import os
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import short_value
from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.custom_stats import CustomStatsCollector
    from pagedllm.core.executor import ModelExecutor
    from pagedllm.core.grammar import GrammarManager
    from pagedllm.core.kv_cache.events import KVCacheEvent
    from pagedllm.core.kv_cache.manager import KVCacheManager
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.kv_connectors.base import KVConnectorBase

# Longest an idle loop waits for a compiling grammar (the core's input loop
# must stay responsive to aborts).
GRAMMAR_WAIT_S = 0.01


class StepResult(NamedTuple):
    """What one `EngineCore.step()` did."""

    # The processed step's outputs (none when the step only launched).
    outputs: list[EngineCoreOutput]
    # Tokens the processed step computed (the server's iteration_tokens_total;
    # 0 when nothing was processed).
    num_scheduled_tokens: int
    # False after a step that ran nothing and finished nothing: every
    # unfinished request waits for its grammar (see wait_for_work).
    made_progress: bool


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        scheduler: Scheduler,
        kv_cache_manager: KVCacheManager,
        model_executor: ModelExecutor,
        structured_output_manager: GrammarManager | None,
        max_model_len: int,
        vocab_size: int,
        custom_stats: CustomStatsCollector | None = None,
    ) -> None:
        self.config = config
        # The custom figures plugins report, polled with every make_stats().
        self.custom_stats = custom_stats
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.model_executor = model_executor
        self.structured_output_manager = structured_output_manager
        # The prompt limits add_request checks (and the API process, from READY).
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # PAGEDLLM_DEBUG_KV=1 checks the block invariant after every step.
        self.check_kv_invariants = os.environ.get("PAGEDLLM_DEBUG_KV") == "1"
        # Async scheduling: the steps launched and not yet processed, oldest
        # first (at most two: one running, one scheduled behind it).
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] | None = (
            deque() if scheduler.async_scheduling else None
        )

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        """The KV connector's scheduler side, which the scheduler owns (None
        without kv_transfer); both sides' counts: `scheduler.kv_connector_stats`."""
        return self.scheduler.kv_connector

    # ---------------------------------------------------------------- intake

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        validate_prompt(prompt_token_ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)

    def add_request(self, request: Request) -> None:
        self.validate_prompt(request.prompt_token_ids)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", request.request_id, "a request with this id is still running")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ loop

    def step(self) -> StepResult:
        if self.batch_queue is not None:
            return self.step_with_batch_queue(self.batch_queue)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._record_step(scheduler_output, outputs, runner_output)

    def step_with_batch_queue(
        self, batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]]
    ) -> StepResult:
        """Launch the next step if there is room, then process the oldest
        one, so its outputs come back while the step behind it runs. Returns
        no outputs and no tokens when it only launched (a pipeline's first step)."""
        if self._may_schedule_ahead(batch_queue):
            scheduler_output = self.scheduler.schedule()
            # NOTE: an empty schedule still goes out when it tells the runner
            # of finished or preempted requests.
            if not batch_queue or not scheduler_output.is_empty or scheduler_output.finished_req_ids \
                    or scheduler_output.preempted_req_ids:
                future = self.model_executor.execute_model_async(scheduler_output)
                batch_queue.append((scheduler_output, future))
                if len(batch_queue) == 1 and not scheduler_output.sync_required and not scheduler_output.is_empty:
                    return StepResult([], 0, made_progress=True)
        scheduler_output, future = batch_queue.popleft()
        runner_output = future.result()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._record_step(scheduler_output, outputs, runner_output)

    def _may_schedule_ahead(self, batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]]) -> bool:
        """Room for one more step, something to schedule, and no step in
        flight whose outputs the next schedule needs."""
        if len(batch_queue) >= 2 or not self.scheduler.has_unfinished_requests():
            return False
        return not batch_queue or not batch_queue[-1][0].sync_required

    def _record_step(
        self, scheduler_output: SchedulerOutput, outputs: list[EngineCoreOutput], runner_output: ModelRunnerOutput
    ) -> StepResult:
        if self.custom_stats is not None:
            self.custom_stats.add_rank_figures(runner_output.custom_stats)
        if self.check_kv_invariants:
            self.check_invariants()
        made_progress = not scheduler_output.is_empty or bool(outputs)
        return StepResult(outputs, scheduler_output.total_num_scheduled_tokens, made_progress)

    def wait_for_work(self, timeout_s: float = GRAMMAR_WAIT_S) -> None:
        """For the loop that calls step(), after a step that made no progress
        (`StepResult.made_progress` false: only grammars compiling or
        adapters loading): wait up to `timeout_s` for a compile or a load to
        finish instead of spinning."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.wait_for_compiles(timeout_s)
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.store.wait_for_loads(timeout_s)

    def shutdown(self) -> None:
        """Release the threads the core itself holds (the adapter store's
        loader); the executor is its owner's to stop."""
        if self.scheduler.lora_slots is not None:
            self.scheduler.lora_slots.store.shutdown()

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants(self.scheduler.requests_holding_blocks())

    def has_unfinished_requests(self) -> bool:
        # A step in flight counts: its outputs are still to be processed.
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if self.custom_stats is not None:
            stats.custom_stats = self.custom_stats.take()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What the prefix cache gained and lost since the last call
        (`cache.enable_kv_events`; else nothing)."""
        return self.kv_cache_manager.take_kv_events()


def validate_prompt(prompt_token_ids: list[int], *, max_model_len: int, vocab_size: int) -> None:
    """The prompt checks of `EngineCore.add_request`; the API process runs them
    too (with the core's READY figures) so a bad prompt is a 400 before it is sent."""
    num_tokens = len(prompt_token_ids)
    if num_tokens == 0:
        raise InvalidRequestError("prompt", prompt_token_ids, "the prompt must contain at least one token")
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"<{num_tokens} tokens>",
            f"the prompt has {num_tokens} tokens but max_model_len is {max_model_len} "
            "and at least one token must be generated",
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        # A client's id may have thousands of digits: echo it shortened.
        raise InvalidRequestError(
            "prompt_token_ids", [short_value(t, 24) for t in bad[:5]], f"token ids must be in [0, {vocab_size})"
        )

