"""The per-step message from the engine core to the output processor.

These are msgspec structs: the very objects the scheduler builds cross the
wire to the API process (array-like and with defaults left out, so a
decode step's output is a few bytes), and the in-process client hands them
over untouched. There is no second, wire-only copy.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# NOTE: a run-time import (not TYPE_CHECKING): msgspec resolves the field
# types when it first encodes or decodes.
from pagedllm.core.scheduler_output import LogprobEntry

FinishReason = Literal["stop", "length", "abort"]


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A timestamped event in the engine core (queued, scheduled, preempted)."""

    type: str
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
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
