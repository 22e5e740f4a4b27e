"""The speculation-policy plugin kind: how many tokens each request drafts
for its next step, zero included.

After every step the model runner asks the policy, for the requests that
just sampled, how many drafts each may have (at most `num_speculative_tokens`;
0: the request's next step is a plain decode row). It decides from
`SpecMeasurements` (spec_decode/measurements.py): each request's measured
acceptance and the measured cost of verify, draft and plain steps at this
batch size. The drafter is then asked only for the requests given drafts (a
model drafter, which mirrors every request, is asked for all and its drafts
cut), and the policy sees what it found (`keep_drafts`): a drafter may find
fewer drafts than allowed (n-gram and suffix find none where nothing
matches), and a step in which any request drafts is a verify step for the
whole batch, so the policy may still choose a plain step. Whatever the
policy decides, output is the same as without speculation: it changes only
how fast tokens come.

A policy registers through the `register_spec_policies` hook under the name
`speculative.policy` selects, and is built as `PolicyCls(config)`.
Built-ins: `adaptive` (the default, spec_decode/adaptive_policy.py),
`batch_size` (vLLM's `disable_by_batch_size`) and `always`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.spec_decode.measurements import SpecMeasurements


class SpeculationPolicy(ABC):
    """Decides per step and per request how many tokens to draft."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens

    @abstractmethod
    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        """For each of `req_ids` (the requests of the next step, which
        sampled this one, in batch order; the batch size is their number)
        a draft count in 0..num_speculative_tokens."""

    def keep_drafts(self, req_ids: Sequence[str], num_drafts: Sequence[int], measurements: SpecMeasurements) -> bool:
        """After the drafter proposed `num_drafts[i]` drafts for each of
        `req_ids` (at most what `num_drafts()` allowed): whether the step
        verifies them (False: every request takes a plain decode row)."""
        return True


class AlwaysPolicy(SpeculationPolicy):
    """Every request drafts k, every step (speculation as it was before policies)."""

    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        return [self.num_speculative_tokens] * len(req_ids)


class BatchSizePolicy(SpeculationPolicy):
    """vLLM's `disable_by_batch_size`: k below that many requests, 0 from it on
    (k always while it is unset)."""

    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        limit = self.config.disable_by_batch_size
        k = 0 if limit is not None and len(req_ids) >= limit else self.num_speculative_tokens
        return [k] * len(req_ids)
