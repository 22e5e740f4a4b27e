"""The unified token-budget scheduler.

Each step hands out at most `max_num_batched_tokens` tokens. Running requests
are served first (one decode token each, or the next chunk of their prompt),
then waiting requests in policy order. Prefill and decode are not separate
phases: a request simply needs `num_tokens - num_computed_tokens` more tokens.
While decodes run, prompt chunks and admissions share only the step time
that keeps the step within its latency target (core/step_budget.py,
Sarathi-Serve's stall-free batching); the order between requests is the
same. When the KV cache runs out, the scheduler preempts by recompute. While
requests wait, fair sharing (core/fair_share.py) keeps one API request's many
sequences from holding every seat (`max_num_seqs`).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.errors import ConfigError, InvalidRequestError, KVTransferError
from pagedllm.core.fair_share import FairShare
from pagedllm.core.kv_transfer_tracker import KVTransferTracker
from pagedllm.core.lora_slots import LOADING
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.scheduler_output import (
    DRAFT_PLACEHOLDER,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.stats import SchedulerStats, SpecDecodingStats, StepCostStats
from pagedllm.core.step_budget import LatencyBoundedBudget, PrefillShare, StepBudget
from pagedllm.core.step_cost import StepShape, attention_pairs

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig
    from pagedllm.core.grammar import GrammarManager
    from pagedllm.core.kv_cache.block_pool import KVCacheBlock
    from pagedllm.core.kv_cache.manager import KVCacheManager
    from pagedllm.core.lora_slots import LoRASlotTable
    from pagedllm.core.scheduler_output import KVConnectorStats, SpecStepTimes
    from pagedllm.kv_connectors.base import KVConnectorBase


class AdmitDecision(enum.Enum):
    """What admission decides for the request at the head of the waiting queue."""

    # Scheduled this step; its blocks are allocated.
    ADMIT = "admit"
    # Stays waiting but steps aside this step (its grammar still compiles, its
    # KV connector is still loading): the requests behind it are tried.
    DEFER_NOT_READY = "defer_not_ready"
    # Stays at the head (too few free blocks, or its whole prompt exceeds the
    # token budget without chunked prefill): the requests behind it wait too.
    DEFER_NO_ROOM = "defer_no_room"
    # Can never run (its grammar failed to compile, its KV load failed): it is
    # finished with the error.
    FAIL = "fail"


class Admission(NamedTuple):
    """Admission's answer for one waiting request: counts on ADMIT, error on FAIL."""

    decision: AdmitDecision
    num_new_tokens: int = 0
    # Prefix-cache and connector hits included.
    num_computed_tokens: int = 0
    # Of those, the tokens the KV connector loads.
    num_external_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class _ScheduledBatch:
    """What one schedule() call has decided so far, and the token budget left."""

    token_budget: int
    now: float
    # What prompt chunks and admissions may add beside the running decodes
    # (core/step_budget.py); None: every token of token_budget.
    prefill_share: PrefillShare | None
    # Insertion order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: dict[str, CachedRequestData] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    # A running request was preempted because the free blocks ran out.
    preempted_for_blocks: bool = False

    def add(self, request_id: str, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = num_new_tokens
        self.token_budget -= num_new_tokens

    def prefill_tokens(self, num_cached_tokens: int) -> int:
        """The most tokens a prompt chunk after `num_cached_tokens` may have."""
        share = self.prefill_share
        return self.token_budget if share is None else min(self.token_budget, share.tokens_for(num_cached_tokens))

    def take_prefill(self, num_tokens: int, num_cached_tokens: int) -> None:
        if self.prefill_share is not None:
            self.prefill_share.take(num_tokens, num_cached_tokens)

    def remove(self, request_id: str) -> None:
        """A request preempted after it was scheduled gives its tokens back."""
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is not None:
            self.token_budget += num_tokens
            self.cached_reqs.pop(request_id, None)
            self.spec_tokens.pop(request_id, None)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        structured_output_manager: GrammarManager | None = None,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        kv_connector: KVConnectorBase | None = None,
        lora_slots: LoRASlotTable | None = None,
    ) -> None:
        self.config = scheduler_config
        # The LoRA adapters' slots and store (core/lora_slots.py); None unless lora.enable_lora.
        self.lora_slots = lora_slots
        # KV transfer (kv_connectors/): the connector's scheduler side, and its
        # bookkeeping (external prefix hits past the local cache, loads and
        # saves handed to the runner with each step, delayed frees).
        self.kv_connector = kv_connector
        self.kv_transfer = None if kv_connector is None else KVTransferTracker(kv_connector, kv_cache_manager)
        # Speculative decoding: k drafts per request at most; a model drafter writes
        # KV past the scheduled tokens, into `num_lookahead_tokens` extra slots.
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        # This interval's (make_stats takes them) and since start.
        self.spec_decoding_stats = SpecDecodingStats.new(num_spec_tokens) if num_spec_tokens else None
        self.total_spec_decoding_stats = SpecDecodingStats.new(num_spec_tokens) if num_spec_tokens else None
        # A request may be scheduled before its last step's output is seen
        # (with a drafter, its drafts are placeholders the runner fills); not
        # with a KV connector (it needs each step's results first).
        self.async_scheduling = scheduler_config.async_scheduling and kv_connector is None
        # Async scheduling: requests preempted while a step of theirs ran (its
        # rejected drafts no longer count against num_computed_tokens).
        self._preempted_in_flight: set[str] = set()
        self.structured_output_manager = structured_output_manager
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.policy = scheduler_config.scheduling_policy
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.fair_share = scheduler_config.fair_share
        self._check_budget_fits_a_sequence(max_model_len)
        # Latency-bounded steps: prompts get what fits beside the running decodes.
        self.step_budget = LatencyBoundedBudget.from_config(scheduler_config)
        self.requests: dict[str, Request] = {}
        # Unfinished sequences per group, and how many groups have several (fair sharing).
        self._group_sizes: dict[str, int] = {}
        self._num_multi_sequence_groups = 0
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); the runner must forget them.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Prompt positions actually run through the model (prefix-cache and
        # connector hits excluded; a recomputed preemption counts again).
        self.num_prompt_tokens_computed = 0
        # Requests finished inside schedule() (a grammar that failed to
        # compile); reported by the next update_from_output.
        self._finished_outputs: list[EngineCoreOutput] = []

    def _check_budget_fits_a_sequence(self, max_model_len: int) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            # Else a long prompt, or a preempted request's recompute of prompt +
            # outputs, could never be scheduled (vLLM has the same rule).
            raise ConfigError(
                "scheduler.max_num_batched_tokens",
                self.max_num_batched_tokens,
                f">= max_model_len ({max_model_len}) when scheduler.enable_chunked_prefill is false; "
                "enable chunked prefill or lower model.max_model_len",
            )

    # ---------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        if request.lora is not None and self.lora_slots is None:
            raise InvalidRequestError(
                "lora", request.lora.name, "this engine serves no LoRA adapters (start it with --enable-lora)"
            )
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise InvalidRequestError(
                    "structured_outputs", request.sampling_params.structured_outputs,
                    "this scheduler has no structured-output manager",
                )
            # Compiles on the manager's threads; WAITING_FOR_FSM until done.
            self.structured_output_manager.grammar_init(request)
        if request.lora is not None and self.lora_slots is not None:
            self.lora_slots.add_request(request.lora)  # its adapter loads in the background
        self.requests[request.request_id] = request
        self._count_in_group(request, +1)
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, stop string)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        # Delayed frees keep the loop stepping until the connector lets go.
        return (
            self.get_num_unfinished_requests() > 0 or bool(self._finished_outputs)
            or (self.kv_transfer is not None and bool(self.kv_transfer.delayed_free))
        )

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        budget = self._step_budget()
        batch = _ScheduledBatch(budget.token_budget, now=time.time(), prefill_share=budget.prefill_share)
        self._schedule_running(batch)
        # Waiting requests get a turn unless this step already had to preempt.
        if not batch.preempted_for_blocks and self.waiting:
            fair = self._fair_share_now()
            self._schedule_waiting(batch, fair)
            if fair is not None and self._yield_seat(batch, fair):
                self._schedule_waiting(batch, fair)
        scheduler_output = self._make_scheduler_output(batch)
        self._update_after_schedule(batch.num_scheduled_tokens, batch.spec_tokens)
        return scheduler_output

    def _step_budget(self) -> StepBudget:
        step_budget = self.step_budget
        if step_budget is None or not step_budget.cost_model.fitted:
            return StepBudget(self.max_num_batched_tokens, None)
        decodes, backlog_tokens = self._decode_load()
        backlog_tokens += sum(request.num_tokens - request.num_computed_tokens for request in self.waiting)
        return step_budget.budget(decodes, backlog_tokens)

    def _decode_load(self) -> tuple[StepShape, int]:
        """The next step of the running decodes alone (one token each, and
        their drafts), and the prompt tokens the running chunks have left."""
        num_tokens = num_reqs = backlog_tokens = 0
        pairs = 0.0
        for request in self.running:
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_needed = request.num_tokens + num_placeholders - num_computed
            if num_needed > 1:
                backlog_tokens += num_needed  # a prompt chunk: the prompts' share
                continue
            num_new = 1 + (self.num_spec_tokens if num_placeholders else len(request.spec_token_ids))
            num_tokens += num_new
            num_reqs += 1
            pairs += attention_pairs(num_new, num_computed)
        return StepShape(num_tokens, num_reqs, False, pairs), backlog_tokens

    def _step_shape(self, batch: _ScheduledBatch) -> StepShape:
        """The shape of the step just scheduled, for the cost model."""
        num_scheduled_tokens, spec_tokens = batch.num_scheduled_tokens, batch.spec_tokens
        pairs = 0.0
        mixed = False
        computed: list[tuple[str, int]] = [(data.req_id, data.num_computed_tokens) for data in batch.new_reqs]
        computed += [(data.req_id, data.num_computed_tokens) for data in batch.cached_reqs.values()]
        for request_id, num_computed in computed:
            num_new = num_scheduled_tokens[request_id]
            pairs += attention_pairs(num_new, num_computed)
            mixed = mixed or num_new > 1 + len(spec_tokens.get(request_id, ()))
        return StepShape(sum(num_scheduled_tokens.values()), len(num_scheduled_tokens), mixed, pairs)

    def _schedule_running(self, batch: _ScheduledBatch) -> None:
        """Phase 1: running requests in order (decode first): the next decode
        token with its drafts, or the next prompt chunk; preempt by recompute
        when the free blocks run out."""
        # NOTE: this loop runs for every running request every step; the
        # common decode case must stay cheap (see benchmarks/scheduler_overhead.py).
        kv_cache_manager = self.kv_cache_manager
        num_lookahead_tokens = self.num_lookahead_tokens
        for request in list(self.running):
            if batch.token_budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_computed_tokens = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            if num_placeholders and not self._may_run_ahead(request, num_placeholders):
                continue
            num_drafts = self._num_draft_placeholders(request, num_placeholders) if num_placeholders else len(
                request.spec_token_ids)
            num_needed = request.num_tokens + num_placeholders - num_computed_tokens
            # More than the next token: a prompt chunk, within the prompts' share.
            prefilling = num_needed > 1
            budget = batch.prefill_tokens(num_computed_tokens) if prefilling else batch.token_budget
            num_new_tokens = self._cap_new_tokens(num_needed + num_drafts, budget, num_computed_tokens)
            if num_new_tokens == 0:
                continue
            while True:
                new_blocks = kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
                )
                if new_blocks is not None or self._preempt_for_blocks(batch) is request:
                    break
            if new_blocks is None:
                continue  # it was the victim itself
            request_id = request.request_id
            # batch.add(), inlined: one call less per running request.
            batch.num_scheduled_tokens[request_id] = num_new_tokens
            batch.token_budget -= num_new_tokens
            if prefilling:
                batch.take_prefill(num_new_tokens, num_computed_tokens)
            cached = batch.cached_reqs[request_id] = CachedRequestData(
                request_id, [block.block_id for block in new_blocks] if new_blocks else [], num_computed_tokens,
                num_output_placeholders=num_placeholders,
            )
            if kv_cache_manager.num_kv_cache_groups > 1:
                cached.other_group_block_ids = kv_cache_manager.new_block_ids_of_other_groups
            if num_drafts:
                num_spec = num_new_tokens + num_computed_tokens - request.num_tokens - num_placeholders
                if num_spec > 0:
                    batch.spec_tokens[request_id] = (
                        [DRAFT_PLACEHOLDER] * num_spec if num_placeholders else request.spec_token_ids[:num_spec]
                    )

    def _may_run_ahead(self, request: Request, num_placeholders: int) -> bool:
        """Async scheduling: may `request` compute another token before the
        `num_placeholders` tokens in flight are known here? Not if they may
        end it by length, nor under a grammar (its bitmask needs them)."""
        max_tokens = request.sampling_params.max_tokens
        return (
            request.structured_output_request is None
            and request.num_tokens + num_placeholders < self.max_model_len
            and (max_tokens is None or request.num_output_tokens + num_placeholders < max_tokens)
        )

    def _num_draft_placeholders(self, request: Request, num_placeholders: int) -> int:
        """Async scheduling: the drafts to reserve for a request whose last
        step's output (and so its drafts) is not seen yet: k, or fewer where
        its max_tokens could be reached (counting every token in flight as
        accepted). The runner verifies the drafts it has, up to this many."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None or not self.num_spec_tokens:
            return self.num_spec_tokens
        # The last allowed token is the step's bonus/recovered one.
        return max(0, min(self.num_spec_tokens, max_tokens - request.num_output_tokens - num_placeholders - 1))

    def _preempt_for_blocks(self, batch: _ScheduledBatch) -> Request:
        """Preempt the policy's victim so others get its blocks; returns it."""
        victim = self._select_victim()
        self._preempt(victim)
        batch.preempted_req_ids.add(victim.request_id)
        batch.preempted_for_blocks = True
        batch.remove(victim.request_id)
        return victim

    def _fair_share_now(self) -> FairShare | None:
        """This step's seats per group (None when fair sharing is off)."""
        # Only with two groups or more, one of them of several sequences:
        # requests of one sequence each are never over a share.
        if not self.fair_share or not self._num_multi_sequence_groups or len(self._group_sizes) < 2:
            return None
        return FairShare(self.running, self.requests.values(), self.max_num_seqs, self.policy == "priority")

    def _count_in_group(self, request: Request, delta: int) -> None:
        """Keep the unfinished sequences per group (`delta` is +1 or -1)."""
        group_id = request.group_id
        size = self._group_sizes.get(group_id, 0) + delta
        if size:
            self._group_sizes[group_id] = size
        else:
            del self._group_sizes[group_id]
        if (size >= 2) != (size - delta >= 2):
            self._num_multi_sequence_groups += 1 if size >= 2 else -1

    def _yield_seat(self, batch: _ScheduledBatch, fair: FairShare) -> bool:
        """A starved group got no seat this step: preempt (recompute) the
        newest sequence of the group furthest above its share, so the starved
        group can take its seat and blocks; True if one was preempted."""
        victim = fair.victim(self.running)
        if victim is None:
            return False
        self._preempt(victim)
        fair.preempted(victim)
        batch.preempted_req_ids.add(victim.request_id)
        batch.remove(victim.request_id)
        return True

    def _schedule_waiting(self, batch: _ScheduledBatch, fair: FairShare | None = None) -> None:
        """Phase 2: admit waiting requests in policy order while the token
        budget and the seats (max_num_seqs) last; with `fair`, a group at its
        share steps aside while a starved group waits."""
        # Requests not ready yet (or stepping aside) keep their place, for this step only.
        not_ready: list[Request] = []
        if self.lora_slots is not None:
            self.lora_slots.begin_step(self.running)
        while self.waiting and batch.prefill_tokens(0) > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if fair is not None and fair.steps_aside(request):
                not_ready.append(self.waiting.pop())
                continue
            admission = self._try_admit(request, batch.prefill_tokens(request.num_computed_tokens))
            decision = admission.decision
            if decision is AdmitDecision.DEFER_NO_ROOM:
                break  # head-of-line: later arrivals wait behind it
            self.waiting.pop()
            if decision is AdmitDecision.ADMIT:
                self._admit(request, admission, batch)
                if fair is not None:
                    fair.admitted(request)
            elif decision is AdmitDecision.DEFER_NOT_READY:
                not_ready.append(request)
            else:
                self._finish_failed_request(request, admission.error)
        for request in reversed(not_ready):
            self.waiting.prepend(request)

    def _try_admit(self, request: Request, token_budget: int) -> Admission:
        """Decide for the request at the head of the waiting queue. On ADMIT
        its blocks are allocated; nothing else about it has changed yet."""
        if request.status == RequestStatus.WAITING_FOR_FSM:
            so_request = request.structured_output_request
            if so_request is None or not so_request.is_ready():
                return Admission(AdmitDecision.DEFER_NOT_READY)
            if so_request.error is not None:
                return Admission(AdmitDecision.FAIL, error=so_request.error)
            request.status = RequestStatus.WAITING
        if request.lora is not None and self.lora_slots is not None:
            blocker = self.lora_slots.blocker(request.lora)
            if blocker == LOADING:  # loading, or max_loras other adapters run this step
                return Admission(AdmitDecision.DEFER_NOT_READY)
            if blocker is not None:
                return Admission(AdmitDecision.FAIL, error=blocker)
        computed_blocks: list[KVCacheBlock] = []
        num_computed_tokens = request.num_computed_tokens
        num_external_tokens = 0
        if num_computed_tokens == 0:
            computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self.kv_transfer is not None:
                try:
                    num_external = self.kv_transfer.num_external_tokens(request, num_computed_tokens)
                except KVTransferError as exc:
                    return Admission(AdmitDecision.FAIL, error=str(exc))
                if num_external is None:  # the connector says: not yet
                    return Admission(AdmitDecision.DEFER_NOT_READY)
                num_external_tokens = num_external
        num_new_tokens = request.num_tokens - num_computed_tokens - num_external_tokens
        if not self.enable_chunked_prefill and num_new_tokens > token_budget:
            return Admission(AdmitDecision.DEFER_NO_ROOM)
        num_computed_tokens += num_external_tokens
        num_new_tokens = self._cap_new_tokens(num_new_tokens, token_budget, num_computed_tokens)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_computed_tokens, computed_blocks, self.num_lookahead_tokens
        )
        if new_blocks is None:
            return Admission(AdmitDecision.DEFER_NO_ROOM)
        return Admission(AdmitDecision.ADMIT, num_new_tokens, num_computed_tokens, num_external_tokens)

    def _admit(self, request: Request, admission: Admission, batch: _ScheduledBatch) -> None:
        """The admitted request joins the running ones, scheduled this step."""
        request_id = request.request_id
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        if self.kv_transfer is not None:
            self.kv_transfer.after_alloc(request, admission.num_external_tokens)
        num_computed_tokens = admission.num_computed_tokens
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = batch.now
        if request.lora is not None and self.lora_slots is not None:
            self.lora_slots.admit(request.lora)
        self.running.append(request)
        block_ids = self.kv_cache_manager.get_block_ids(request_id)
        other_group_block_ids = self.kv_cache_manager.get_other_group_block_ids(request_id)
        if resumed:
            batch.cached_reqs[request_id] = CachedRequestData(
                req_id=request_id,
                new_block_ids=block_ids,
                num_computed_tokens=num_computed_tokens,
                resumed_from_preemption=True,
                other_group_block_ids=other_group_block_ids,
            )
        else:
            batch.new_reqs.append(
                NewRequestData(
                    req_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=block_ids,
                    num_computed_tokens=num_computed_tokens,
                    eos_token_id=request.eos_token_id,
                    other_group_block_ids=other_group_block_ids,
                    lora=request.lora,
                )
            )
        batch.add(request_id, admission.num_new_tokens)
        batch.take_prefill(admission.num_new_tokens, num_computed_tokens)

    def _make_scheduler_output(self, batch: _ScheduledBatch) -> SchedulerOutput:
        """Phase 3: what the runner needs for this step."""
        num_scheduled_tokens = batch.num_scheduled_tokens
        structured_output_request_ids = self._structured_output_request_ids(num_scheduled_tokens, batch.spec_tokens)
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=batch.new_reqs,
            scheduled_cached_reqs=list(batch.cached_reqs.values()),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=batch.spec_tokens,
            structured_output_request_ids=structured_output_request_ids,
            grammar_bitmask=(
                self.structured_output_manager.grammar_bitmask(
                    self.requests, structured_output_request_ids, batch.spec_tokens
                )
                if structured_output_request_ids and self.structured_output_manager is not None
                else None
            ),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=batch.preempted_req_ids,
            # NOTE: a request still reasoning needs this step's tokens too:
            # they say whether its next step samples under its grammar.
            sync_required=self._samples_under_grammar(num_scheduled_tokens),
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else [],
            step_shape=None if self.step_budget is None or not num_scheduled_tokens else self._step_shape(batch),
        )
        if self.kv_transfer is not None:
            self.kv_transfer.attach_metadata(scheduler_output)
        self.finished_req_ids = set()
        return scheduler_output

    def _structured_output_request_ids(
        self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]
    ) -> list[str]:
        """Requests that sample this step and follow a grammar: they get
        bitmask rows. Not one still reasoning, unless a draft may end it."""
        manager = self.structured_output_manager
        if manager is None:
            return []
        return [
            request_id
            for request_id, num_new_tokens in num_scheduled_tokens.items()
            if self._samples_with_grammar(self.requests[request_id], num_new_tokens)
            and (spec_tokens.get(request_id) or manager.is_reasoning_ended(self.requests[request_id]))
        ]

    def _samples_with_grammar(self, request: Request, num_new_tokens: int) -> bool:
        return (
            request.structured_output_request is not None
            and request.num_computed_tokens + num_new_tokens >= request.num_tokens
        )

    def _samples_under_grammar(self, num_scheduled_tokens: dict[str, int]) -> bool:
        if self.structured_output_manager is None:
            return False
        return any(
            self._samples_with_grammar(self.requests[request_id], num_new_tokens)
            for request_id, num_new_tokens in num_scheduled_tokens.items()
        )

    def _update_after_schedule(self, num_scheduled_tokens: dict[str, int], spec_tokens: dict[str, list[int]]) -> None:
        # The tokens are as good as computed: the runner executes the steps
        # in order, this one before the next (NOTE: rejected drafts are
        # subtracted in update_from_output).
        async_scheduling = self.async_scheduling
        for request_id, num_new_tokens in num_scheduled_tokens.items():
            request = self.requests[request_id]
            if request.num_computed_tokens < request.num_prompt_tokens:
                num_prompt_tokens = min(num_new_tokens, request.num_prompt_tokens - request.num_computed_tokens)
                self.num_prompt_tokens_computed += num_prompt_tokens
                if request.lora is not None and self.lora_slots is not None:
                    self.lora_slots.count_tokens(request.lora, num_prompt_tokens, 0)
            request.num_computed_tokens += num_new_tokens
            if async_scheduling:
                # It samples this step: its token and its drafts (all of them
                # accepted, until the output says how many were).
                num_drafts = len(spec_tokens.get(request_id, ()))
                if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders + num_drafts:
                    request.num_output_placeholders += 1 + num_drafts

    def _finish_failed_request(self, request: Request, error: str) -> None:
        """A request that cannot run (a grammar that failed to compile, a KV
        block that failed to load) ends alone: abort, with the error as
        stop_reason, reported by the next update_from_output."""
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = error
        self._free_request(request)
        self._finished_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason="abort",
                stop_reason=error, num_cached_tokens=0,
            )
        )

    def _cap_new_tokens(self, num_new_tokens: int, token_budget: int, num_computed_tokens: int) -> int:
        threshold = self.long_prefill_token_threshold
        # The threshold splits long prefills: a chunking policy, off without chunking.
        if self.enable_chunked_prefill and 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        # Positions must stay below max_model_len.
        return max(0, min(num_new_tokens, token_budget, self.max_model_len - num_computed_tokens))

    def _select_victim(self) -> Request:
        # Fair sharing: among equals, the group holding the most seats gives
        # one up (else the request just admitted for a starved group would be
        # the victim: FCFS takes the newest).
        seats = Counter(r.group_id for r in self.running) if self.fair_share else Counter[str]()
        if self.policy == "priority":
            # Lowest priority (largest value), latest arrival among equals.
            return max(self.running, key=lambda r: (r.priority, seats[r.group_id], r.arrival_time))
        # FCFS: the newest (of the largest group).
        return max(reversed(self.running), key=lambda r: seats[r.group_id])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        # NOTE: generated tokens are kept; recompute covers prompt + outputs.
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if request.num_output_placeholders:
            self._preempted_in_flight.add(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # --------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        if self.kv_transfer is not None:
            self.kv_transfer.update_from_output(runner_output.kv_connector_output)
        if runner_output.spec_step is not None:
            self._account_spec_step(runner_output.spec_step)
        if self.step_budget is not None and scheduler_output.step_shape is not None:
            self.step_budget.cost_model.observe(scheduler_output.step_shape, runner_output.execute_time_s)
        sampled_token_ids = runner_output.sampled_token_ids
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        all_logprobs = runner_output.logprobs
        all_prompt_logprobs = runner_output.prompt_logprobs
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished (aborted) while the step ran
            sampled = sampled_token_ids.get(request_id, ())
            if sampled:
                self._account_drafts(request, spec_tokens.get(request_id), len(sampled), runner_output)
            # Async scheduling: a request preempted while its step ran still
            # gets that step's token (it was computed from its own KV).
            preempted = request.status == RequestStatus.PREEMPTED
            num_new_tokens, stopped = self._append_sampled_tokens(request, sampled)
            if num_new_tokens and request.lora is not None and self.lora_slots is not None:
                self.lora_slots.count_tokens(request.lora, 0, num_new_tokens)
            if sampled:
                # The drafts the next step verifies (none while prefilling).
                request.spec_token_ids = [] if stopped else self._usable_drafts(request, runner_output)
            logprobs = all_logprobs.get(request_id) if all_logprobs else None
            prompt_logprobs = all_prompt_logprobs.get(request_id) if all_prompt_logprobs else None
            if stopped:
                (self.waiting if preempted else self.running).remove(request)
                self._free_request(request)
            if num_new_tokens or stopped or prompt_logprobs:
                outputs.append(
                    EngineCoreOutput(
                        request_id=request_id,
                        new_token_ids=list(sampled[:num_new_tokens]),
                        new_logprobs=logprobs[:num_new_tokens] if logprobs is not None else None,
                        new_prompt_logprobs=prompt_logprobs,
                        finish_reason=request.get_finished_reason() if stopped else None,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        first_scheduled_time=request.first_scheduled_time,
                        spec_counts=self._spec_counts(request),
                    )
                )
        return outputs

    def _spec_counts(self, request: Request) -> tuple[int, int, int] | None:
        """The request's drafting figures so far (None without a drafter)."""
        if not self.num_spec_tokens:
            return None
        return request.spec_num_drafts, request.spec_num_draft_tokens, request.spec_num_accepted_tokens

    def _account_drafts(
        self, request: Request, drafts: list[int] | None, num_sampled: int, runner_output: ModelRunnerOutput
    ) -> None:
        """A sampling step's output is seen: its drafts past the accepted
        prefix were not computed for real, its placeholders are resolved."""
        num_scheduled_drafts = len(drafts) if drafts else 0
        # Preempted while this step ran (async scheduling): its count started over.
        preempted_in_flight = request.request_id in self._preempted_in_flight
        if self.async_scheduling:
            request.num_output_placeholders -= 1 + num_scheduled_drafts
            self._preempted_in_flight.discard(request.request_id)
        if not drafts:
            return
        if not preempted_in_flight:
            request.num_computed_tokens -= num_scheduled_drafts + 1 - num_sampled
        num_draft_tokens = len(drafts)
        if drafts[0] == DRAFT_PLACEHOLDER:
            num_draft_tokens = runner_output.num_placeholder_drafts.get(request.request_id, 0)
            if not num_draft_tokens:
                return  # the runner had no drafts for them: nothing was verified
        request.spec_num_drafts += 1
        request.spec_num_draft_tokens += num_draft_tokens
        request.spec_num_accepted_tokens += num_sampled - 1
        if self.spec_decoding_stats is not None and self.total_spec_decoding_stats is not None:
            self.spec_decoding_stats.observe_draft(num_draft_tokens, num_sampled - 1)
            self.total_spec_decoding_stats.observe_draft(num_draft_tokens, num_sampled - 1)

    def _account_spec_step(self, times: SpecStepTimes) -> None:
        if self.spec_decoding_stats is not None and self.total_spec_decoding_stats is not None:
            self.spec_decoding_stats.observe_step(times)
            self.total_spec_decoding_stats.observe_step(times)

    def _append_sampled_tokens(self, request: Request, sampled: Sequence[int]) -> tuple[int, bool]:
        """Append tokens until one stops the request: (tokens appended, stopped)."""
        num_new_tokens = 0
        stopped = False
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            num_new_tokens += 1
            if self._check_stop(request):
                stopped = True
                break
        so_request = request.structured_output_request
        manager = self.structured_output_manager
        if num_new_tokens and so_request is not None and so_request.grammar is not None and manager is not None:
            grammar = so_request.grammar
            grammar_token_ids = manager.grammar_token_ids(request, sampled[:num_new_tokens])
            if grammar_token_ids:
                grammar.accept_tokens(request.request_id, grammar_token_ids)
            if not stopped and grammar.is_terminated():
                # e.g. ignore_eos: the grammar has ended, so has the request.
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
        return num_new_tokens, stopped

    def _usable_drafts(self, request: Request, runner_output: ModelRunnerOutput) -> list[int]:
        drafts = runner_output.spec_token_ids.get(request.request_id)
        if not drafts:
            return []
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            # The last allowed token is the step's bonus/recovered one.
            drafts = drafts[: max(0, max_tokens - request.num_output_tokens - 1)]
        so_request = request.structured_output_request
        manager = self.structured_output_manager
        if (
            drafts and so_request is not None and so_request.grammar is not None
            and manager is not None and manager.is_reasoning_ended(request)
        ):
            # Drafts the grammar rejects would be rejected by sampling anyway.
            drafts = so_request.grammar.validate_tokens(drafts)
        return list(drafts)

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        max_tokens = params.max_tokens
        num_output_tokens = request.num_output_tokens
        if request.num_tokens >= self.max_model_len or (max_tokens is not None and num_output_tokens >= max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if num_output_tokens < params.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        return False

    def _free_request(self, request: Request) -> None:
        request.finished_time = time.time()
        request.structured_output_request = None
        # A connector's save may still read the blocks: the tracker frees them later.
        if self.kv_transfer is None or not self.kv_transfer.request_finished(request):
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self._preempted_in_flight.discard(request.request_id)
        if self.lora_slots is not None:
            self.lora_slots.free_request(request)
        del self.requests[request.request_id]
        self._count_in_group(request, -1)

    def requests_holding_blocks(self) -> list[Request]:
        """Running requests and finished ones a connector still reads."""
        if self.kv_transfer is None:
            return list(self.running)
        return [*self.running, *self.kv_transfer.delayed_free.values()]

    # ----------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        prefix_stats = self.kv_cache_manager.take_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=self._take_spec_decoding_stats(),
            kv_connector_stats=None if self.kv_transfer is None else self.kv_transfer.take_stats(),
            lora_stats=(
                None if self.lora_slots is None else self.lora_slots.make_stats(self.running, self.waiting)
            ),
            step_cost_stats=None if self.step_budget is None else self._step_cost_stats(self.step_budget),
        )

    @staticmethod
    def _step_cost_stats(step_budget: LatencyBoundedBudget) -> StepCostStats:
        cost_model = step_budget.cost_model
        return StepCostStats(
            coefficients=cost_model.named_coefficients(), num_samples=cost_model.num_samples,
            relative_error=cost_model.relative_error, target_s=step_budget.last_target_s,
            prefill_budget=step_budget.last_prefill_budget,
        )

    @property
    def kv_connector_stats(self) -> KVConnectorStats | None:
        """The KV connector's counts since start: its scheduler side's and
        its worker sides' (summed over the ranks)."""
        return None if self.kv_transfer is None else self.kv_transfer.stats

    def _take_spec_decoding_stats(self) -> SpecDecodingStats | None:
        stats = self.spec_decoding_stats
        if stats is None:
            return None
        self.spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        return stats
