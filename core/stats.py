"""The engine's statistics (vLLM's v1/metrics/stats.py).

What the scheduler reports after a step (one type from the core to every
consumer: the wire, the stat loggers, the Prometheus exporter; msgspec
structs, so the same objects go on the wire), and what the front end's
output processor counts for every batch of engine-core outputs it processes
(`IterationStats`, `FinishedRequestStats`; the stat loggers turn them into
Prometheus observations and the periodic log line). All times are
wall-clock seconds (time.time()), the clock request metrics use on both
processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

# NOTE: run-time imports: msgspec resolves the field types on first use.
from pagedllm.core.custom_stats import FigureValue
from pagedllm.kv_connectors.base import KVConnectorStats

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import SpecStepTimes


class SpecDecodingStats(msgspec.Struct, array_like=True):
    num_spec_tokens: int  # k: the length of num_accepted_tokens_per_pos
    num_drafts: int = 0  # verification steps of requests that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []
    # Steps the runner timed, their summed times, and the policy's choices
    # over them (SpecStepTimes): the split `pagedllm bench spec` reports.
    num_steps: int = 0
    verify_time_s: float = 0.0
    draft_time_s: float = 0.0
    num_sampled_reqs: int = 0
    num_drafted_reqs: int = 0

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(min(num_accepted_tokens, self.num_spec_tokens)):
            self.num_accepted_tokens_per_pos[position] += 1

    def observe_step(self, times: SpecStepTimes) -> None:
        self.num_steps += 1
        self.verify_time_s += times.verify_s
        self.draft_time_s += times.draft_s
        self.num_sampled_reqs += times.num_sampled_reqs
        self.num_drafted_reqs += times.num_drafted_reqs

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_steps += other.num_steps
        self.verify_time_s += other.verify_time_s
        self.draft_time_s += other.draft_time_s
        self.num_sampled_reqs += other.num_sampled_reqs
        self.num_drafted_reqs += other.num_drafted_reqs
        if len(other.num_accepted_tokens_per_pos) > len(self.num_accepted_tokens_per_pos):
            grow = len(other.num_accepted_tokens_per_pos) - len(self.num_accepted_tokens_per_pos)
            self.num_accepted_tokens_per_pos.extend([0] * grow)
            self.num_spec_tokens = len(self.num_accepted_tokens_per_pos)
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def drafted_fraction(self) -> float:
        """Of the requests that sampled, the fraction the policy let draft."""
        return self.num_drafted_reqs / self.num_sampled_reqs if self.num_sampled_reqs else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [count / self.num_drafts if self.num_drafts else 0.0 for count in self.num_accepted_tokens_per_pos]

    def describe(self) -> str:
        per_position = ", ".join(f"{rate:.3f}" for rate in self.per_position_acceptance_rate)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Draft acceptance rate: {self.acceptance_rate * 100:.1f}%, "
            f"Per-position acceptance rate: {per_position}"
        )


class LoRAStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Multi-LoRA figures (core/lora_slots.py): the adapters now (vLLM's
    `vllm:lora_requests_info` labels), and counts by adapter name since the
    previous stats."""

    max_lora: int
    # Names of the adapters of running / waiting requests, sorted.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Adapters the engine core holds loaded (at most lora.max_cpu_loras
    # unless more are in use).
    num_loaded_adapters: int = 0
    # Deltas: each finished load's seconds; requests added, prompt tokens
    # computed and tokens generated, by adapter name.
    load_times_s: list[float] = []
    requests: dict[str, int] = {}
    prompt_tokens: dict[str, int] = {}
    generation_tokens: dict[str, int] = {}


class StepCostStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The step cost model's fit (core/step_cost.py) and the latency-bounded
    budget it gave the last step with decodes (core/step_budget.py)."""

    # Seconds per unit of each term (step, mixed, token, request, attention);
    # empty before the first fit.
    coefficients: dict[str, float] = {}
    # Steps observed since start.
    num_samples: int = 0
    # Moving mean of |predicted - measured| / measured.
    relative_error: float = 0.0
    # The last step with decodes: its latency target and prompt-token share.
    target_s: float = 0.0
    prefill_budget: int = 0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The scheduler's figures after a step, as the core sends them with the
    step's outputs (and with its idle heartbeat); the stat loggers and
    Prometheus read exactly this. Queue lengths and KV usage are the state
    now; prefix-cache counts, drafts and connector counts are deltas since
    the previous stats."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # cumulative
    # Verified drafts since the last stats (interval delta); None without speculation.
    spec_decoding_stats: SpecDecodingStats | None = None
    # The KV connector's counters since the last stats; None without one.
    kv_connector_stats: KVConnectorStats | None = None
    # Custom figures plugins attached (core/custom_stats.py): counters' increase
    # since the last stats, gauges' value, histograms' new observations; None
    # when no component reported any.
    custom_stats: dict[str, FigureValue] | None = None
    # Multi-LoRA serving's figures; None unless lora.enable_lora.
    lora_stats: LoRAStats | None = None
    # The step cost model and latency bound; None when steps are not bounded.
    step_cost_stats: StepCostStats | None = None


class RequestTimes(Protocol):
    """The timestamps of one request that the statistics read (the front
    end's `RequestMetrics`)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished engine request (one sample of an n > 1 request)."""

    finish_reason: str
    e2e_latency: float  # arrival -> finished
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_time: float  # arrival -> first scheduled
    prefill_time: float  # first scheduled -> first token
    inference_time: float  # first scheduled -> last token
    decode_time: float  # first token -> last token
    # decode_time / (num_generation_tokens - 1); None with fewer than 2 tokens.
    mean_time_per_output_token: float | None


@dataclass
class IterationStats:
    """What one engine step (one batch of EngineCoreOutputs) produced."""

    iteration_timestamp: float = field(default_factory=time.time)
    # Prompt lengths of the requests whose first token arrived in this step.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    # One per request that got tokens this step after its first: time since
    # its previous output event (a multi-token step is one event).
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # The `n` of each user request whose every sample finished this step.
    n_params: list[int] = field(default_factory=list)

    def update_from_output(
        self,
        num_new_tokens: int,
        num_prompt_tokens: int,
        metrics: RequestTimes,
        prev_last_token_time: float | None,
        now: float,
    ) -> None:
        """Account one request's output; `prev_last_token_time` is its last
        token time before this step (None: these are its first tokens)."""
        if num_new_tokens <= 0:
            return  # a prompt-logprobs-only chunk or a finish without tokens
        self.num_generation_tokens += num_new_tokens
        if prev_last_token_time is None:
            self.num_prompt_tokens += num_prompt_tokens
            self.time_to_first_tokens.append(now - metrics.arrival_time)
        else:
            self.inter_token_latencies.append(now - prev_last_token_time)

    def update_from_finished_request(
        self,
        finish_reason: str,
        metrics: RequestTimes,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        max_tokens_param: int | None,
        now: float,
    ) -> FinishedRequestStats:
        arrival = metrics.arrival_time
        # A request can finish before it was scheduled or before any token
        # (an abort); its missing phases then count as zero-length.
        scheduled = metrics.first_scheduled_time if metrics.first_scheduled_time is not None else arrival
        first_token = metrics.first_token_time if metrics.first_token_time is not None else scheduled
        last_token = metrics.last_token_time if metrics.last_token_time is not None else first_token
        decode_time = last_token - first_token
        stats = FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=now - arrival,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            max_tokens_param=max_tokens_param,
            queued_time=scheduled - arrival,
            prefill_time=first_token - scheduled,
            inference_time=last_token - scheduled,
            decode_time=decode_time,
            mean_time_per_output_token=(
                decode_time / (num_generation_tokens - 1) if num_generation_tokens > 1 else None
            ),
        )
        self.finished_requests.append(stats)
        return stats
