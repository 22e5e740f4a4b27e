"""The default speculation policy: draft only where it pays for itself.

A request whose drafts are accepted with probability `a` per token gets, from
a k-token draft, `(1 - a^(k+1)) / (1 - a)` tokens per step on average (the
accepted prefix plus the bonus token) instead of 1. Drafting costs time: at
this batch size a step that verifies drafts (and proposes the next ones)
takes `S = verify + rest` seconds against `P = plain + rest` for a plain
decode step (measured, spec_decode/measurements.py). With `r = S / P`, a request drafting k is charged
`1 + (r - 1) * k / k_max` plain steps; the policy picks the k in
0..k_max with the most tokens per charged step, and 0 unless that beats a
plain step by `MIN_GAIN`. A step in which any request drafts is a verify
step for the whole batch (no plain decode graph), so the batch drafts at all
only if its mean expected tokens per request beat `r` by `MIN_GAIN` too.
So speculation is chosen only where it is measured to be faster, per
request and per batch size.

Once the drafter has proposed, the batch check runs again on the drafts it
found (`keep_drafts`): a request for which it found none yields one token
but, beside requests that draft, pays for a verify row (as many as the
longest draft needs: the step is charged `1 + (r - 1) * longest / k_max`);
if the step's expected tokens per request do not beat that by `MIN_GAIN`,
no request drafts this step, unless one is a probe (never verified, or held
without drafts for `PROBE_INTERVAL` steps: it drafts to be measured).

Exploring: a bucket without a measured verify step drafts k_max everywhere,
then one without a measured plain step drafts nothing for a step; a request
never verified drafts k_max; and a request held at 0 for `PROBE_INTERVAL` steps drafts k_max once, so that its
acceptance is measured again. A probe that leaves the request at 0 doubles
the steps before its next one (up to `PROBE_INTERVAL << MAX_PROBE_BACKOFF`):
at batch 32 on the tiny model a verify step of the whole batch costs ~2.6
plain steps, and probing every 16 steps alone cost more than the probes won
(0.95x). Such
probes make the whole step a verify step, so a batch probes at most once
every `PROBE_INTERVAL` steps unless all its requests are waiting to probe
(in a large batch, new requests arriving would otherwise make nearly every
step a verify step); a request waiting to probe drafts nothing.
vLLM's `disable_by_batch_size`, when set, applies first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.spec_decode.measurements import SpecMeasurements, StepCost
from pagedllm.spec_decode.policy import SpeculationPolicy

if TYPE_CHECKING:
    from pagedllm.core.config import SpeculativeConfig

# Tokens per charged step a draft must reach to be chosen over a plain step
# (a margin against timing noise: speculation must not lose).
MIN_GAIN = 1.05
# Steps at 0 drafts after which a request drafts once to re-measure its acceptance.
PROBE_INTERVAL = 16
# A request whose probes keep it at 0 waits PROBE_INTERVAL << n steps after
# its n-th such probe in a row, n at most this.
MAX_PROBE_BACKOFF = 3


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a step yields from `num_drafts` drafts accepted with
    per-token probability `acceptance`: (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(num_drafts + 1)
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def cost_ratio(cost: StepCost) -> float | None:
    """A verify step's time over a plain step's (None: not both measured)."""
    if cost.plain_s is None or cost.verify_s is None:
        return None
    rest = cost.rest_s or 0.0
    plain = cost.plain_s + rest
    return (cost.verify_s + rest) / plain if plain > 0 else None


def best_num_drafts(acceptance: float, ratio: float, max_drafts: int) -> int:
    """The k in 0..max_drafts with the most tokens per charged plain step
    (see the module docstring); 0 unless it gains `MIN_GAIN`."""
    best_k, best_gain = 0, MIN_GAIN
    for k in range(1, max_drafts + 1):
        gain = expected_tokens(acceptance, k) / (1.0 + (ratio - 1.0) * k / max_drafts)
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


class AdaptivePolicy(SpeculationPolicy):
    """Drafts k per request where measured acceptance pays for measured cost."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._steps_since_probe = PROBE_INTERVAL  # the first probe may come at once
        self._probes: set[str] = set()  # the requests probing in the current step
        # Probes in a row after which a request still drafted nothing.
        self._failed_probes: dict[str, int] = {}

    def _grant_probes(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> set[str]:
        """The requests that probe this step: those never verified or held
        back PROBE_INTERVAL steps (more after failed probes), if the whole
        batch is such or no step
        probed in the last PROBE_INTERVAL (a probe makes the whole batch a
        verify step: in a large batch, new requests would otherwise make
        nearly every step one)."""
        failed = self._failed_probes
        if len(failed) > 2 * len(req_ids) + 64:  # drop finished requests' counts
            running = set(req_ids)
            self._failed_probes = failed = {req_id: n for req_id, n in failed.items() if req_id in running}
        candidates = {
            req_id for req_id in req_ids
            if measurements.acceptance(req_id) is None
            or measurements.steps_without_drafts(req_id) >= PROBE_INTERVAL << failed.get(req_id, 0)
        }
        self._steps_since_probe += 1
        if candidates and (len(candidates) == len(req_ids) or self._steps_since_probe > PROBE_INTERVAL):
            self._steps_since_probe = 0
            return candidates
        return set()

    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        k_max = self.num_speculative_tokens
        limit = self.config.disable_by_batch_size
        if limit is not None and len(req_ids) >= limit:
            return [0] * len(req_ids)
        cost = measurements.step_cost(len(req_ids))
        if cost.verify_s is None:
            return [k_max] * len(req_ids)  # measure a verify step at this size
        ratio = cost_ratio(cost)
        if ratio is None:
            return [0] * len(req_ids)  # measure a plain step at this size
        self._probes = self._grant_probes(req_ids, measurements)
        counts, tokens = [], 0.0
        for req_id in req_ids:
            acceptance = measurements.acceptance(req_id)
            if req_id in self._probes:
                counts.append(k_max)
            elif acceptance is None:
                counts.append(0)  # its probe waits
                tokens += 1.0
            else:
                counts.append(best_num_drafts(acceptance, ratio, k_max))
                tokens += expected_tokens(acceptance, counts[-1])
        self._count_failed_probes(req_ids, counts, measurements)
        if not self._probes and tokens / len(req_ids) <= MIN_GAIN * ratio:
            return [0] * len(req_ids)  # the whole step pays the verify cost: not worth it
        return counts

    def _count_failed_probes(
        self, req_ids: Sequence[str], counts: list[int], measurements: SpecMeasurements
    ) -> None:
        """A request probing again (it was verified before) has failed one
        more probe unless it drafts later by choice; one that drafts by
        choice starts over. A first probe is no failure: the drafter may
        find nothing to draft for a while (no match yet)."""
        failed = self._failed_probes
        for req_id, count in zip(req_ids, counts, strict=True):
            if req_id in self._probes and measurements.acceptance(req_id) is not None:
                failed[req_id] = min(MAX_PROBE_BACKOFF, failed.get(req_id, 0) + 1)
            elif count:
                failed.pop(req_id, None)

    def keep_drafts(self, req_ids: Sequence[str], num_drafts: Sequence[int], measurements: SpecMeasurements) -> bool:
        ratio = cost_ratio(measurements.step_cost(len(req_ids)))
        if ratio is None or not any(num_drafts):
            return True  # still measuring this batch size, or nothing to verify
        tokens = 0.0
        for req_id, count in zip(req_ids, num_drafts, strict=True):
            acceptance = measurements.acceptance(req_id)
            if count and (req_id in self._probes or acceptance is None):
                return True  # a probe
            tokens += expected_tokens(acceptance, count) if count and acceptance is not None else 1.0
        # The step verifies as many rows per request as the longest draft needs.
        charged = 1.0 + (ratio - 1.0) * max(num_drafts) / self.num_speculative_tokens
        return tokens / len(req_ids) > MIN_GAIN * charged
