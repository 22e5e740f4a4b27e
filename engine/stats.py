"""Per-step and per-request statistics (vLLM's v1/metrics/stats.py).

The output processor fills an IterationStats for every batch of engine-core
outputs it processes; the stat logger (engine/metrics.py) turns it into
Prometheus observations and the periodic log line. All times are wall-clock
seconds (time.time()), the clock RequestMetrics uses on both processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.engine.outputs import RequestMetrics


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
        metrics: RequestMetrics,
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
        metrics: RequestMetrics,
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
