"""The step cost model: how long one engine step takes, from its shape.

A step's wall time is modelled as a linear function of five terms (each a
coefficient in seconds per unit):

- ``step``: once per step (the launch, the sampler, the output);
- ``mixed``: once per step that holds a prompt chunk (such a step runs
  eagerly, where a decode-only step may replay a captured graph);
- ``token``: per scheduled token (the GEMMs);
- ``request``: per scheduled request (its attention call, its sampling row);
- ``attention``: per 1,024 (query, key) pairs the step's attention reads
  (a chunk of n tokens after c cached ones reads n x (c + n/2)).

The coefficients are fitted from the running steps' measured times
(``ModelRunnerOutput.execute_time_s``) by least squares on the relative
error, with exponential forgetting, so the model follows the platform, the model, the dtype and the
load it actually serves; none is negative (an active-set refit drops a term
whose fit goes below zero). The scheduler asks it, before each step, how many
prompt tokens fit beside the running decodes within the step latency target
(core/step_budget.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

TERMS = ("step", "mixed", "token", "request", "attention")
# Attention work is counted in units of this many (query, key) pairs.
ATTENTION_PAIRS_UNIT = 1024.0


class StepShape(NamedTuple):
    """What a step computes, as the cost model sees it."""

    num_tokens: int
    num_reqs: int
    # True when a request computes a prompt chunk (more than one token past
    # its drafts), so the step cannot replay a decode graph.
    mixed: bool
    # Sum over the step's requests of new_tokens x (cached + new_tokens / 2).
    attention_pairs: float

    def features(self) -> tuple[float, ...]:
        return (1.0, 1.0 if self.mixed else 0.0, float(self.num_tokens), float(self.num_reqs),
                self.attention_pairs / ATTENTION_PAIRS_UNIT)


def attention_pairs(num_new_tokens: int, num_cached_tokens: int) -> float:
    """The (query, key) pairs causal attention reads for a chunk of
    `num_new_tokens` after `num_cached_tokens`."""
    return num_new_tokens * (num_cached_tokens + (num_new_tokens + 1) / 2)


class StepCostModel:
    """Online least-squares fit of step time on StepShape features.

    `forgetting` weighs an observation `k` steps old by forgetting**k (0.995:
    about the last 200 steps count). The model predicts nothing until it has
    seen `min_samples` steps of each kind (decode-only and mixed)."""

    def __init__(self, forgetting: float = 0.995, refit_every: int = 8, min_samples: int = 4,
                 ridge: float = 1e-9) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting={forgetting}: expected in (0, 1]")
        self.forgetting = forgetting
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.ridge = ridge
        n = len(TERMS)
        # Weighted normal equations: sum w x x^T and sum w x y.
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self.coefficients: tuple[float, ...] | None = None
        self.num_samples = 0
        self.num_mixed_samples = 0
        self._since_fit = 0
        # Exponentially weighted mean of |predicted - measured| / measured,
        # over the steps observed while a fit existed.
        self.relative_error = 0.0

    @property
    def fitted(self) -> bool:
        return self.coefficients is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step."""
        if not seconds > 0.0 or not math.isfinite(seconds):
            return
        if self.coefficients is not None:
            error = abs(self.predict_fitted(shape, self.coefficients) - seconds) / seconds
            self.relative_error += 0.05 * (error - self.relative_error)
        # Relative least squares: each step weighs 1 / seconds^2, so a short
        # decode step is predicted as well as a long prefill.
        x = [feature / seconds for feature in shape.features()]
        decay = self.forgetting
        xtx, xty = self._xtx, self._xty
        for i, xi in enumerate(x):
            row = xtx[i]
            for j, xj in enumerate(x):
                row[j] = row[j] * decay + xi * xj
            xty[i] = xty[i] * decay + xi
        self.num_samples += 1
        self.num_mixed_samples += shape.mixed
        self._since_fit += 1
        if self._since_fit >= self.refit_every and self._enough_samples():
            self.refit()

    def _enough_samples(self) -> bool:
        num_decode = self.num_samples - self.num_mixed_samples
        return self.num_mixed_samples >= self.min_samples and num_decode >= self.min_samples

    def refit(self) -> None:
        self._since_fit = 0
        self.coefficients = nonnegative_least_squares(self._xtx, self._xty, self.ridge)

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step should take; None before the first fit."""
        if self.coefficients is None:
            return None
        return self.predict_fitted(shape, self.coefficients)

    @staticmethod
    def predict_fitted(shape: StepShape, coefficients: tuple[float, ...]) -> float:
        return sum(c * x for c, x in zip(coefficients, shape.features(), strict=True))

    def named_coefficients(self) -> dict[str, float]:
        return {} if self.coefficients is None else dict(zip(TERMS, self.coefficients, strict=True))


def nonnegative_least_squares(xtx: list[list[float]], xty: list[float], ridge: float) -> tuple[float, ...]:
    """argmin ||X c - y||^2 + ridge ||c||^2 (relative to each term's scale)
    with c >= 0, from the normal equations: solve on the active terms, drop
    the most negative one, repeat (at most one pass per term)."""
    n = len(xty)
    active = [i for i in range(n) if xtx[i][i] > 0.0]
    while active:
        solution = _solve([[xtx[i][j] + (ridge * xtx[i][i] if i == j else 0.0) for j in active] for i in active],
                          [xty[i] for i in active])
        if solution is None:
            break
        worst = min(range(len(active)), key=lambda k: solution[k])
        if solution[worst] >= 0.0:
            coefficients = [0.0] * n
            for k, i in enumerate(active):
                coefficients[i] = solution[k]
            return tuple(coefficients)
        del active[worst]
    return tuple([0.0] * n)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
