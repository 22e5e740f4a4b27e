"""What the engine returns: vLLM-shaped RequestOutput / CompletionOutput, and
the per-step message from the engine core to the output processor."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import LogprobEntry

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class Logprob:
    """Log probability of one token; `rank` is 1-based in the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token + top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first prompt token has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


class RequestOutputKind(enum.IntEnum):
    """How much each RequestOutput carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, on every step
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate)


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended it; None for EOS / length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding: verification steps with drafts, drafts proposed,
    # drafts accepted (all 0 without speculation).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts; None when nothing was drafted."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        """Tokens per verification step, 1 + accepted / drafts."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class EngineCoreEvent:
    """A timestamped event in the engine core (queued, scheduled, preempted)."""

    type: str
    timestamp: float


@dataclass(slots=True)
class EngineCoreOutput:
    """What the engine core reports about one request after a step.

    Emitted for a request that got new tokens, finished, or computed prompt
    positions with `prompt_logprobs` this step. The output processor turns a
    stream of these into RequestOutputs.

    - `new_token_ids`: tokens appended this step (the last one may be the EOS or
      stop token that finished it).
    - `new_logprobs`: one LogprobEntry per new token (token_ids[0] is the
      sampled token, then the top-k; `rank` is the sampled token's rank), or
      None when the request did not ask for logprobs.
    - `new_prompt_logprobs`: entries for the prompt positions computed this
      step, in order; the entry of prompt position 0 is None. Chunked prefill
      sends them in several pieces.
    - `finish_reason`: "stop" (EOS or stop token), "length", "abort" or None;
      `stop_reason` the stop token id (None for EOS).
    - `num_cached_tokens`: prompt tokens hit in the prefix cache (-1 or 0
      before the request is first scheduled).
    - `first_scheduled_time`: time.time() of its first scheduling.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry] | None = None
    new_prompt_logprobs: list[LogprobEntry | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    events: list[EngineCoreEvent] | None = None
    # Cumulative (num_drafts, num_draft_tokens, num_accepted_tokens) of the
    # request; None without speculation.
    spec_counts: tuple[int, int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
