"""What a speculation policy decides from: each request's measured acceptance
and the measured cost of a step at each batch size.

The model runner fills it (worker/model_runner.py): after every verification
it records how many of a request's drafts were proposed and accepted, and
after every decode step how long the runner took for it (the target's
forward pass, sampling or verification; for a step that scored drafts, a
*verify* step, the drafter's `propose` for the next step too; one without is
a *plain* decode step, timed without the propose unless the drafter runs
every step, as a model drafter mirroring the target does) and how long passed
outside the runner since the previous step (scheduling, output processing:
the *rest*, paid by both kinds of step). Times are exponential moving
averages per batch-size bucket (the next power of two), so a policy compares
steps of similar size; a sample counts as at most twice the average so far
(`_CostEma`).

A request's acceptance starts from what the drafter achieved on the requests
before it: its first verification updates a prior of one verification's
worth at the drafter-wide average, so that one unlucky draft (all rejected
at once) does not read as an acceptance of 0 and hold the request back.
That average is over finished requests, each weighing the same (its own
averages when it finished), and over verifications only until a request
finished: averaged by verification, the last few requests of a batch, the
slow ones that are verified alone for tens of steps, decided it (a batch-8
ngram run's prior fell to ~0.2 from one request at 0.03, and held requests
whose own first probes later read 0.7-0.99 back for 16 steps).
"""

from __future__ import annotations

from dataclasses import dataclass


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size` (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


class _Ema:
    """An exponential moving average; None until the first observation."""

    __slots__ = ("decay", "value")

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def observe(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


@dataclass(frozen=True)
class StepCost:
    """Mean seconds per step at one batch-size bucket (None: not measured yet)."""

    plain_s: float | None  # the runner's time for a step that scored no drafts (a model drafter's mirror included)
    verify_s: float | None  # the runner's time for a step that scored drafts (the propose after it included)
    rest_s: float | None  # outside the runner between two steps


# A step-time sample counts as at most this many times the average so far.
OUTLIER_FACTOR = 2.0


class _CostEma(_Ema):
    """A step-time average that one slow step moves little: a sample above
    OUTLIER_FACTOR x the average counts as that much (a garbage collection
    or a capture in a step would otherwise hold a verify or plain cost far
    off for as long as the policy avoids that kind of step)."""

    __slots__ = ()

    def observe(self, sample: float) -> None:
        if self.value is not None:
            sample = min(sample, OUTLIER_FACTOR * self.value)
        super().observe(sample)


class _BucketCost:
    def __init__(self, decay: float) -> None:
        self.plain, self.verify, self.rest = _CostEma(decay), _CostEma(decay), _CostEma(decay)

    def snapshot(self) -> StepCost:
        return StepCost(self.plain.value, self.verify.value, self.rest.value)


class SpecMeasurements:
    """Per-request acceptance and per-bucket step costs (see the module docstring)."""

    def __init__(
        self, acceptance_decay: float = 0.7, cost_decay: float = 0.9, prior_decay: float = 0.9, *,
        drafter_prior: bool = True,
    ) -> None:
        """`drafter_prior` False: a request's acceptance comes from its own
        verifications only."""
        self.acceptance_decay = acceptance_decay
        self.drafter_prior = drafter_prior
        self.cost_decay = cost_decay
        # req_id -> (accepted positions, positions tried), moving averages per verification.
        self._acceptance: dict[str, tuple[_Ema, _Ema]] = {}
        # The same over every request's verifications, and over finished
        # requests' own averages: a new request's prior (the second once a
        # request finished).
        self._prior = (_Ema(prior_decay), _Ema(prior_decay))
        self._finished_prior = (_Ema(prior_decay), _Ema(prior_decay))
        self._costs: dict[int, _BucketCost] = {}
        # Steps each request went without drafts since it last drafted.
        self._steps_without_drafts: dict[str, int] = {}

    # ---------------------------------------------------------- acceptance

    def observe_acceptance(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification of `num_proposed` drafts that kept `num_accepted`:
        `num_accepted` positions accepted, then one rejected unless all were."""
        if num_proposed <= 0:
            return
        kept = self._acceptance.get(req_id)
        if kept is None:
            kept = self._acceptance[req_id] = (_Ema(self.acceptance_decay), _Ema(self.acceptance_decay))
            if self.drafter_prior:
                prior = self._finished_prior if self._finished_prior[1].value else self._prior
                for ema, prior_ema in zip(kept, prior, strict=True):
                    ema.value = prior_ema.value
        num_tried = num_accepted + (num_accepted < num_proposed)
        for (accepted, tried) in (kept, self._prior):
            accepted.observe(num_accepted)
            tried.observe(num_tried)

    def acceptance(self, req_id: str) -> float | None:
        """The request's per-position acceptance probability a (None: never
        verified): accepted positions over positions tried, each a moving
        average. A draft is accepted position by position up to the first
        rejection, so accepted / proposed would understate a (a = 0.8 and
        k = 4 accept 2.36 of 4 drafts, 0.59, on average)."""
        kept = self._acceptance.get(req_id)
        if kept is None or not kept[1].value:
            return None
        return (kept[0].value or 0.0) / kept[1].value

    def observe_drafted(self, req_id: str, num_drafts: int) -> None:
        """`req_id`'s next step verifies `num_drafts` drafts (0: the policy
        gave none, the drafter found none, or the policy dropped them)."""
        if num_drafts > 0:
            self._steps_without_drafts[req_id] = 0
        else:
            self._steps_without_drafts[req_id] = self._steps_without_drafts.get(req_id, 0) + 1

    def steps_without_drafts(self, req_id: str) -> int:
        return self._steps_without_drafts.get(req_id, 0)

    def forget(self, req_id: str) -> None:
        """The request finished: its averages join the finished requests'
        prior, and what was kept for it is dropped."""
        kept = self._acceptance.pop(req_id, None)
        if kept is not None and kept[1].value:
            for prior_ema, ema in zip(self._finished_prior, kept, strict=True):
                prior_ema.observe(ema.value or 0.0)
        self._steps_without_drafts.pop(req_id, None)

    # ---------------------------------------------------------------- cost

    def observe_step(self, batch_size: int, *, verified: bool, step_s: float, rest_s: float | None) -> None:
        """A decode step of `batch_size` requests: the runner's time for it (a
        verify step if it scored drafts) and the time outside the runner
        before it (None: unknown)."""
        bucket = self._costs.setdefault(batch_bucket(batch_size), _BucketCost(self.cost_decay))
        (bucket.verify if verified else bucket.plain).observe(step_s)
        if rest_s is not None:
            bucket.rest.observe(rest_s)

    def step_cost(self, batch_size: int) -> StepCost:
        bucket = self._costs.get(batch_bucket(batch_size))
        return StepCost(None, None, None) if bucket is None else bucket.snapshot()
