"""The ``prometheus`` stat logger's step cost collectors (core/stats.py
StepCostStats): the fitted step cost model and the latency bound it gives.

They are created with the first step cost figures, so an engine whose steps
are not latency-bounded (``--max-step-latency-ms 0``, or no chunked prefill)
exposes none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from pagedllm.core.step_cost import TERMS
from pagedllm.stat_loggers.base import METRIC_PREFIX

if TYPE_CHECKING:
    from pagedllm.core.stats import StepCostStats


class StepCostMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self.coefficient = Gauge(
            METRIC_PREFIX + "step_cost_coefficient_seconds",
            "The step cost model's fitted seconds per unit of each term (step, mixed, token, request, "
            "attention per 1024 query-key pairs).",
            [*labels, "term"], registry=registry,
        )
        self.samples = Gauge(
            METRIC_PREFIX + "step_cost_fit_samples", "Steps the step cost model has been fitted on.", labels,
            registry=registry,
        )
        self.error = Gauge(
            METRIC_PREFIX + "step_cost_fit_relative_error",
            "Moving mean of |predicted - measured| / measured step time.", labels, registry=registry,
        )
        self.target = Gauge(
            METRIC_PREFIX + "step_latency_target_seconds",
            "The step latency target of the last step with running decodes.", labels, registry=registry,
        )
        self.prefill_budget = Gauge(
            METRIC_PREFIX + "step_prefill_token_budget",
            "Prompt tokens the last step with running decodes could take within the target.", labels,
            registry=registry,
        )

    def record(self, stats: StepCostStats) -> None:
        name = self.model_name
        for term in TERMS:
            if term in stats.coefficients:
                self.coefficient.labels(name, term).set(stats.coefficients[term])
        self.samples.labels(name).set(stats.num_samples)
        self.error.labels(name).set(stats.relative_error)
        self.target.labels(name).set(stats.target_s)
        self.prefill_budget.labels(name).set(stats.prefill_budget)
