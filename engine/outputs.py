"""What the front ends return: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from pagedllm.core.outputs import FinishReason


class Logprob(msgspec.Struct, gc=False):
    """Log probability of one token; `rank` is 1-based in the vocabulary.

    NOTE: gc=False (it holds only a float, an int and a str, so no cycle):
    a non-streaming request keeps n x max_tokens x (1 + logprobs) of these
    until it ends, and the collector walking millions of them stalled the
    API server's event loop for seconds; untracked, their dicts are too.
    """

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
