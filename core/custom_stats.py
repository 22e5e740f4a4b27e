"""Custom figures: named metrics that plugins of other kinds (a KV connector,
a drafter, ...) attach to the engine core's stats.

A component declares its figures with a class attribute and reports their
values when the engine core makes its stats (after every step)::

    class MyConnector(KVConnectorBase):
        custom_metrics = (
            MetricSpec("blocks_saved", MetricType.COUNTER, "KV blocks saved to storage."),
            MetricSpec("save_queue_len", MetricType.GAUGE, "Saves in flight."),
        )

        def get_custom_stats(self) -> dict[str, float | list[float]]:
            return {"blocks_saved": self.num_saved, "save_queue_len": len(self.queue)}

What each type reports: a counter its total since start (the engine core
sends the increase since the previous stats), a gauge its value now, a
histogram the observations made since its previous report (a list). Where
several instances report one figure (the scheduler and worker sides of a
connector, several ranks), counters and gauges add up and histograms merge:
each instance reports what it counts itself.

The figures travel in :attr:`pagedllm.core.stats.SchedulerStats.custom_stats`
(plain floats and lists, msgspec), reach every stat logger, and the built-in
Prometheus logger exposes each as ``pagedllm:<name>`` with the ``model_name``
label. The builder (engine/builder.py) checks the declarations when the
engine is built (``stat_loggers/base.py``: ``validate_metric_specs``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

logger = logging.getLogger(__name__)

# One figure's value on the wire: a counter's increase or a gauge's value
# (float), or a histogram's observations (list of floats).
FigureValue = float | list[float]


class MetricType(enum.StrEnum):
    """The Prometheus type a custom figure is declared with."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class MetricSpec(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One custom figure's declaration (it goes to the API process in the
    engine core's READY message, so the stat loggers know every figure
    before the first value arrives)."""

    name: str  # [a-zA-Z_][a-zA-Z0-9_]*; exposed as `pagedllm:<name>`
    type: MetricType
    help: str  # the Prometheus HELP text
    # A histogram's bucket upper bounds (ascending); None = Prometheus' defaults.
    buckets: list[float] | None = None


@runtime_checkable
class CustomStatsSource(Protocol):
    """A component that reports custom figures: it declares them in
    ``custom_metrics`` and returns their values from ``get_custom_stats``
    (called where the component lives: the engine core polls the KV
    connector's scheduler side when it makes its stats; a rank polls its
    drafter and connector worker side after each of its steps)."""

    custom_metrics: Sequence[MetricSpec]

    def get_custom_stats(self) -> Mapping[str, Any]: ...


class CustomStatsCollector:
    """Polls the engine core's sources each time it makes its stats and
    turns their reports into one ``{name: value}`` for SchedulerStats.

    ``sources``: (owner, component) pairs, the owner naming the component in
    messages ("kv_connector 'my_connector'"). The declarations were validated
    by the builder; here a report of an undeclared name or of a wrong value
    type is logged once and left out (a metric bug must not stop serving).
    """

    def __init__(
        self, sources: Sequence[tuple[str, CustomStatsSource]], specs: Sequence[MetricSpec] | None = None
    ) -> None:
        """``specs``: every figure the engine reports (default: the sources'
        declarations); the builder adds those of components on other ranks."""
        self.sources = list(sources)
        self.specs: dict[str, MetricSpec] = {}
        for spec in specs if specs is not None else [s for _, source in self.sources for s in source.custom_metrics]:
            self.specs.setdefault(spec.name, spec)
        # Figures the ranks sent with their step outputs.
        self._from_ranks: dict[str, FigureValue] = {}
        # (source index, counter name) -> the total it reported last time.
        self._last_totals: dict[tuple[int, str], float] = {}
        self._warned: set[tuple[str, str]] = set()

    @property
    def metrics(self) -> list[MetricSpec]:
        return list(self.specs.values())

    def add_rank_figures(self, figures: Mapping[str, FigureValue] | None) -> None:
        """Figures the ranks collected (already increases, values and new
        observations) and sent with a step's output."""
        if figures:
            merge_figures(self._from_ranks, figures)

    def take(self) -> dict[str, FigureValue] | None:
        """The figures since the previous call; None when no source reported any."""
        figures, self._from_ranks = self._from_ranks, {}
        for index, (owner, source) in enumerate(self.sources):
            for name, value in source.get_custom_stats().items():
                spec = self.specs.get(name)
                if spec is None:
                    self._warn_once(owner, name, "it reports a figure it did not declare in custom_metrics")
                    continue
                parsed = _parse_value(spec, value)
                if parsed is None:
                    self._warn_once(owner, name, f"a {spec.type} needs {_EXPECTED[spec.type]}, got {value!r}")
                    continue
                self._merge(figures, index, spec, parsed)
        return figures or None

    def _merge(self, figures: dict[str, FigureValue], index: int, spec: MetricSpec, value: FigureValue) -> None:
        name = spec.name
        if spec.type == MetricType.COUNTER:
            assert isinstance(value, float)
            last = self._last_totals.get((index, name), 0.0)
            # A smaller total means the component started over: count from zero.
            increase = value - last if value >= last else value
            self._last_totals[(index, name)] = value
            previous = figures.get(name, 0.0)
            assert isinstance(previous, float)
            figures[name] = previous + increase  # several sources (ranks, sides) add up
        elif spec.type == MetricType.HISTOGRAM:
            assert isinstance(value, list)
            observations = figures.setdefault(name, [])
            assert isinstance(observations, list)
            observations.extend(value)
        else:
            assert isinstance(value, float)
            previous = figures.get(name, 0.0)
            assert isinstance(previous, float)
            figures[name] = previous + value  # a gauge: several sources' values add up

    def _warn_once(self, owner: str, name: str, reason: str) -> None:
        if (owner, name) not in self._warned:
            self._warned.add((owner, name))
            logger.error("custom figure %r of %s left out: %s", name, owner, reason)


_EXPECTED = {
    MetricType.COUNTER: "a finite number >= 0 (its total since start)",
    MetricType.GAUGE: "a finite number",
    MetricType.HISTOGRAM: "a list of finite numbers (the observations since its last report)",
}


def merge_figures(into: dict[str, FigureValue], figures: Mapping[str, FigureValue]) -> dict[str, FigureValue]:
    """Add collected figures of several ranks into `into`: numbers (counter
    increases, gauges) add up, observation lists are concatenated."""
    for name, value in figures.items():
        previous = into.get(name)
        if isinstance(value, list):
            into[name] = [*previous, *value] if isinstance(previous, list) else list(value)
        else:
            into[name] = (previous if isinstance(previous, float) else 0.0) + value
    return into


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _parse_value(spec: MetricSpec, value: object) -> FigureValue | None:
    if spec.type == MetricType.HISTOGRAM:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            return None
        numbers = [_number(item) for item in value]
        return None if any(n is None for n in numbers) else [n for n in numbers if n is not None]
    number = _number(value)
    if number is None or (spec.type == MetricType.COUNTER and number < 0):
        return None
    return number


__all__ = ["CustomStatsCollector", "CustomStatsSource", "FigureValue", "MetricSpec", "MetricType", "merge_figures"]
