"""Latency-bounded steps (Sarathi-Serve's stall-free batching).

A decode that shares a step with a prompt chunk waits for all of it: with a
fixed token budget (``scheduler.max_num_batched_tokens``) a 2,048-token chunk
freezes every stream for the chunk's whole time. While decodes run, the
scheduler therefore gives prompts only the tokens that fit beside them within
a target step time, as the step cost model (core/step_cost.py) predicts it.
A batch with no running decode gets the whole token budget: nobody waits.

The target is ``scheduler.max_step_latency_ms``, or by default the larger of
AUTO_MIN_STEP_S and AUTO_DECODE_FACTOR times the running decodes' own
predicted step: a chunk may at most stretch a decode step that much, so the
inter-token tail stays within a small multiple of the median. Until the model
has its first fit the plain token budget applies.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.step_cost import ATTENTION_PAIRS_UNIT, TERMS, StepCostModel, StepShape

if TYPE_CHECKING:
    from pagedllm.core.config import SchedulerConfig

# The default target: at least this long, and at least this multiple of the
# decode-only step (chosen from benchmarks/peer/serving.py, docs/performance.md).
AUTO_MIN_STEP_S = 0.050
AUTO_DECODE_FACTOR = 2.0
# Prompts always progress, however slow the decodes alone are.
MIN_PREFILL_TOKENS = 32


class StepBudget(NamedTuple):
    """One step's budget: tokens in all, and of them the prompt tokens
    (prefill chunks, admissions) beside the running decodes."""

    token_budget: int
    prefill_budget: int


class LatencyBoundedBudget:
    def __init__(self, max_num_batched_tokens: int, max_step_latency_ms: float | None,
                 cost_model: StepCostModel | None = None) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: the automatic target.
        self.target_s = None if max_step_latency_ms is None else max_step_latency_ms / 1000.0
        self.cost_model = cost_model or StepCostModel()
        # The last step with decodes: its target and prompt share (for the stats).
        self.last_target_s = 0.0
        self.last_prefill_budget = max_num_batched_tokens

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> LatencyBoundedBudget | None:
        """None when steps are not bounded: without chunked prefill (a prompt
        cannot be split) or at max_step_latency_ms 0."""
        if not config.enable_chunked_prefill or config.max_step_latency_ms == 0:
            return None
        return cls(config.max_num_batched_tokens, config.max_step_latency_ms)

    def budget(self, decodes: StepShape | None) -> StepBudget:
        """The budget of a step whose running decodes are `decodes` (None:
        no decode runs, so prompts get everything)."""
        full = self.max_num_batched_tokens
        if decodes is None or decodes.num_reqs == 0:
            return StepBudget(full, full)
        coefficients = self.cost_model.coefficients
        if coefficients is None:
            return StepBudget(full, full)
        decode_s = StepCostModel.predict_fitted(decodes, coefficients)
        target_s = self.target_s if self.target_s is not None else max(AUTO_MIN_STEP_S,
                                                                        AUTO_DECODE_FACTOR * decode_s)
        # The step with one prompt chunk of 0 tokens: decodes + a request + mixed.
        base = StepShape(decodes.num_tokens, decodes.num_reqs + 1, True, decodes.attention_pairs)
        remaining_s = target_s - StepCostModel.predict_fitted(base, coefficients)
        prompt_tokens = prompt_tokens_within(remaining_s, dict(zip(TERMS, coefficients, strict=True)))
        room = max(0, full - decodes.num_tokens)
        prefill_budget = min(room, max(MIN_PREFILL_TOKENS, prompt_tokens))
        self.last_target_s, self.last_prefill_budget = target_s, prefill_budget
        return StepBudget(full, prefill_budget)


def prompt_tokens_within(remaining_s: float, coefficients: dict[str, float]) -> int:
    """The most prompt tokens P (one fresh chunk) whose GEMM and attention
    cost fits in `remaining_s`: token x P + attention x P (P + 1) / 2 / unit."""
    if remaining_s <= 0.0:
        return 0
    quadratic = coefficients["attention"] / (2.0 * ATTENTION_PAIRS_UNIT)
    linear = coefficients["token"] + quadratic
    if quadratic > 0.0:
        tokens = (-linear + math.sqrt(linear * linear + 4.0 * quadratic * remaining_s)) / (2.0 * quadratic)
    elif linear > 0.0:
        tokens = remaining_s / linear
    else:
        return 1 << 30
    return int(tokens)
