"""What the front ends return: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, overload

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


# One position's logprobs as (token id, Logprob) pairs: tuples of untracked
# objects, which the garbage collector untracks in turn (a dict it would not).
LogprobPairs = tuple[tuple[int, Logprob], ...]


class PackedLogprobs(Sequence[dict[int, Logprob] | None]):
    """A read-only sequence of per-position logprob dicts (vLLM returns a
    list of them: `list(packed)` is one), each made when it is read.

    NOTE: held as LogprobPairs, so the collector scans none of it: n=128 x
    1,500 tokens of 20 logprobs kept as dicts in lists made every full
    collection in the API process walk ~600k items with the GIL held (up to
    200 ms, /health included), and making the dicts when the request
    finishes would cost ~300 ms on the event loop; the handlers read them
    in the request worker pool instead.
    """

    __slots__ = ("_packed",)

    def __init__(self, packed: Iterable[LogprobPairs | None]) -> None:
        self._packed = tuple(packed)

    def __len__(self) -> int:
        return len(self._packed)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob] | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob] | None]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [None if pairs is None else dict(pairs) for pairs in self._packed[index]]
        pairs = self._packed[index]
        return None if pairs is None else dict(pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedLogprobs):
            return self._packed == other._packed
        return isinstance(other, Sequence) and not isinstance(other, (str, bytes)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


# One dict per generated token: token id -> Logprob (the sampled token + top-k);
# a list, or a PackedLogprobs from the engine.
SampleLogprobs = Sequence[dict[int, Logprob]]
# One entry per prompt token; the first prompt token has no logprob (None).
PromptLogprobs = Sequence[dict[int, Logprob] | None]


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
    # The adapter it ran with (a lora.request.LoRARequest; None: the base model).
    lora_request: Any = None
