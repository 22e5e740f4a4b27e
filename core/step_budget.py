"""Latency-bounded steps (Sarathi-Serve's stall-free batching).

A decode that shares a step with a prompt chunk waits for all of it: with a
fixed token budget (``scheduler.max_num_batched_tokens``) a 2,048-token chunk
freezes every stream for the chunk's whole time. While decodes run, the
scheduler therefore gives prompts only the tokens that fit beside them within
a target step time, as the step cost model (core/step_cost.py) predicts it.
A batch with no running decode gets the whole token budget: nobody waits.
Nor do prompts starve: each step takes at least a sixteenth of the prompt
tokens waiting (BACKLOG_HORIZON_STEPS), whatever the target.

The target is ``scheduler.max_step_latency_ms``, or by default the larger of
AUTO_MIN_STEP_S and AUTO_DECODE_FACTOR times the running decodes' own
predicted step: a chunk may at most stretch a decode step that much, so the
inter-token tail stays within a small multiple of the median. Until the model
has its first fit the plain token budget applies.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.step_cost import ATTENTION_PAIRS_UNIT, TERMS, StepCostModel, StepShape, attention_pairs

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig

# The default target: at least this long, and at least this multiple of the
# decode-only step (chosen from benchmarks/peer/serving.py, docs/performance.md).
AUTO_MIN_STEP_S = 0.050
AUTO_DECODE_FACTOR = 3.0
# Prompts always progress, however slow the decodes alone are.
MIN_PREFILL_TOKENS = 32
# And never slower than draining the prompt tokens waiting now (the queue's
# and the running chunks' rest) in this many steps: else a target relative to
# the running decodes is a spiral (fewer decodes, a shorter target, fewer
# prompt tokens, fewer decodes) and the queue grows while steps stay short.
BACKLOG_HORIZON_STEPS = 16


class StepBudget(NamedTuple):
    """One step's budget: tokens in all, and the prompts' share of the step
    time beside the running decodes (None: prompts may take every token)."""

    token_budget: int
    prefill_share: PrefillShare | None


class PrefillShare:
    """The step time prompt chunks may still add within the target, handed
    out as tokens: a chunk after more cached tokens reads more keys, so it
    gets fewer. The first `min_tokens` are granted whatever the time."""

    def __init__(self, seconds: float, coefficients: dict[str, float], max_tokens: int, min_tokens: int) -> None:
        self.seconds_left = seconds
        self.coefficients = coefficients
        # The token budget left beside the decodes.
        self.tokens_left = max_tokens
        # Granted whatever the time.
        self.floor_left = min(min_tokens, max_tokens)
        self.num_chunks = 0

    def _chunk_overhead_s(self) -> float:
        # The first chunk's request and eager step are in the share's base.
        return self.coefficients["request"] if self.num_chunks else 0.0

    def tokens_for(self, num_cached_tokens: int) -> int:
        """The most tokens a chunk after `num_cached_tokens` may have."""
        tokens = prompt_tokens_within(self.seconds_left - self._chunk_overhead_s(), self.coefficients,
                                      num_cached_tokens)
        return min(self.tokens_left, max(self.floor_left, tokens))

    def take(self, num_tokens: int, num_cached_tokens: int) -> None:
        self.seconds_left -= self._chunk_overhead_s() + chunk_seconds(num_tokens, num_cached_tokens,
                                                                      self.coefficients)
        self.tokens_left -= num_tokens
        self.floor_left = max(0, self.floor_left - num_tokens)
        self.num_chunks += 1


class LatencyBoundedBudget:
    def __init__(self, max_num_batched_tokens: int, max_step_latency_ms: float | None,
                 cost_model: StepCostModel | None = None) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: the automatic target.
        self.target_s = None if max_step_latency_ms is None else max_step_latency_ms / 1000.0
        self.cost_model = cost_model or StepCostModel()
        # The last step with decodes: its target and a fresh prompt's chunk (for the stats).
        self.last_target_s = 0.0
        self.last_prefill_budget = max_num_batched_tokens

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> LatencyBoundedBudget | None:
        """None when steps are not bounded: without chunked prefill (a prompt
        cannot be split) or at max_step_latency_ms 0."""
        if not config.enable_chunked_prefill or config.max_step_latency_ms == 0:
            return None
        return cls(config.max_num_batched_tokens, config.max_step_latency_ms)

    def budget(self, decodes: StepShape | None, backlog_tokens: int = 0) -> StepBudget:
        """The budget of a step whose running decodes are `decodes` (None:
        no decode runs, so prompts get everything) while `backlog_tokens`
        prompt tokens wait to be computed."""
        full = self.max_num_batched_tokens
        coefficients = self.cost_model.coefficients
        if decodes is None or decodes.num_reqs == 0 or coefficients is None:
            return StepBudget(full, None)
        decode_s = StepCostModel.predict_fitted(decodes, coefficients)
        target_s = self.target_s if self.target_s is not None else max(AUTO_MIN_STEP_S,
                                                                        AUTO_DECODE_FACTOR * decode_s)
        # The step with one prompt chunk of 0 tokens: decodes + a request + mixed.
        base = StepShape(decodes.num_tokens, decodes.num_reqs + 1, True, decodes.attention_pairs)
        min_tokens = max(MIN_PREFILL_TOKENS, -(-backlog_tokens // BACKLOG_HORIZON_STEPS))
        share = PrefillShare(target_s - StepCostModel.predict_fitted(base, coefficients),
                             dict(zip(TERMS, coefficients, strict=True)), max(0, full - decodes.num_tokens), min_tokens)
        self.last_target_s, self.last_prefill_budget = target_s, share.tokens_for(0)
        return StepBudget(full, share)


def chunk_seconds(num_tokens: int, num_cached_tokens: int, coefficients: dict[str, float]) -> float:
    """A chunk's token and attention cost (not its request's)."""
    return (coefficients["token"] * num_tokens
            + coefficients["attention"] * attention_pairs(num_tokens, num_cached_tokens) / ATTENTION_PAIRS_UNIT)


def prompt_tokens_within(remaining_s: float, coefficients: dict[str, float], num_cached_tokens: int = 0) -> int:
    """The most tokens P of a chunk after `num_cached_tokens` whose cost fits in
    `remaining_s`: token x P + attention x P (cached + (P + 1) / 2) / unit."""
    if remaining_s <= 0.0:
        return 0
    quadratic = coefficients["attention"] / (2.0 * ATTENTION_PAIRS_UNIT)
    linear = coefficients["token"] + coefficients["attention"] * (num_cached_tokens + 0.5) / ATTENTION_PAIRS_UNIT
    if quadratic > 0.0:
        tokens = (-linear + math.sqrt(linear * linear + 4.0 * quadratic * remaining_s)) / (2.0 * quadratic)
    elif linear > 0.0:
        tokens = remaining_s / linear
    else:
        return 1 << 30
    return int(tokens)
