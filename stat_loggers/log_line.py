"""The built-in stat logger ``logging``: vLLM's periodic "Avg prompt
throughput" line (LoggingStatLogger), on logger ``pagedllm.metrics``.

It sums what it records between two ``log()`` calls (every
``server.log_stats_interval_s``) and logs rates over that interval; custom
figures are appended (a counter's increase over the interval, a gauge's
latest value, a histogram's count and mean).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pagedllm.core.custom_stats import MetricType
from pagedllm.core.stats import SpecDecodingStats
from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext

if TYPE_CHECKING:
    from pagedllm.core.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagedllm.metrics")


class LoggingStatLogger(StatLoggerBase):
    def __init__(self, context: StatLoggerContext) -> None:
        super().__init__(context)
        self.custom_types = {spec.name: spec.type for spec in context.custom_metrics}
        self.last_scheduler_stats: SchedulerStats | None = None
        self.last_log_time = time.monotonic()
        self._last_throughputs = (0.0, 0.0)
        self.interval_spec_decoding_stats: SpecDecodingStats | None = None
        self.last_line = ""
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.interval_prompt_tokens = self.interval_generation_tokens = 0
        self.interval_prefix_cache_queries = self.interval_prefix_cache_hits = 0
        self.interval_external_queries = self.interval_external_hits = 0
        # name -> counter increase or gauge value; name -> histogram observations
        self.interval_custom: dict[str, float] = {}
        self.interval_custom_observations: dict[str, list[float]] = {}

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        num_scheduled_tokens: int | None = None,
    ) -> None:
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.interval_prefix_cache_queries += scheduler_stats.prefix_cache_queries
            self.interval_prefix_cache_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.kv_connector_stats is not None:
                self.interval_external_queries += scheduler_stats.kv_connector_stats.external_queries
                self.interval_external_hits += scheduler_stats.kv_connector_stats.external_hits
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                if self.interval_spec_decoding_stats is None:
                    self.interval_spec_decoding_stats = SpecDecodingStats.new(spec.num_spec_tokens)
                self.interval_spec_decoding_stats.add(spec)
            self._record_custom(scheduler_stats.custom_stats or {})
        if iteration_stats is not None:
            self.interval_prompt_tokens += iteration_stats.num_prompt_tokens
            self.interval_generation_tokens += iteration_stats.num_generation_tokens

    def _record_custom(self, figures: dict[str, float | list[float]]) -> None:
        for name, value in figures.items():
            kind = self.custom_types.get(name)
            if isinstance(value, list):
                self.interval_custom_observations.setdefault(name, []).extend(value)
            elif kind == MetricType.COUNTER:
                self.interval_custom[name] = self.interval_custom.get(name, 0.0) + value
            else:
                self.interval_custom[name] = value

    def log(self, now: float | None = None) -> None:
        """Log the line over the interval since the last one, then start a
        new interval (the line is kept in ``last_line``)."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_log_time
        prompt_throughput = self.interval_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_throughput = self.interval_generation_tokens / elapsed if elapsed > 0 else 0.0
        queries, hits = self.interval_prefix_cache_queries, self.interval_prefix_cache_hits
        hit_rate = hits / queries if queries else 0.0
        line = (
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"{_describe_queues(self.last_scheduler_stats)}, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        if self.interval_external_queries:
            external_rate = self.interval_external_hits / self.interval_external_queries
            line += f", External prefix cache hit rate: {external_rate * 100:.1f}%"
        line += self._describe_spec_decoding() + self._describe_custom()
        # An idle server would repeat the same zero line forever (vLLM: debug).
        idle = not any((prompt_throughput, generation_throughput, *self._last_throughputs))
        logger.log(logging.DEBUG if idle else logging.INFO, "%s", line)
        self._last_throughputs = (prompt_throughput, generation_throughput)
        self.last_log_time = now
        self.last_line = line
        self._reset_interval()

    def _describe_spec_decoding(self) -> str:
        spec = self.interval_spec_decoding_stats
        if spec is None:
            return ""
        self.interval_spec_decoding_stats = SpecDecodingStats.new(spec.num_spec_tokens)
        if not spec.num_drafts:
            return ""
        return (
            f", Spec decode acceptance rate: {spec.acceptance_rate * 100:.1f}%, "
            f"Mean acceptance length: {spec.mean_acceptance_length:.2f}, "
            "Per-position acceptance rate: "
            + ", ".join(f"{count / spec.num_drafts:.3f}" for count in spec.num_accepted_tokens_per_pos)
        )

    def _describe_custom(self) -> str:
        parts = [f"{name}: {value:g}" for name, value in sorted(self.interval_custom.items())]
        for name, observations in sorted(self.interval_custom_observations.items()):
            mean = sum(observations) / len(observations)
            parts.append(f"{name}: {len(observations)} obs, mean {mean:g}")
        return "".join(", " + part for part in parts)


def _describe_queues(stats: SchedulerStats | None) -> str:
    # No stats from the core yet: say so rather than print zeros it never reported.
    if stats is None:
        return "Running: n/a, Waiting: n/a, KV cache usage: n/a"
    return (
        f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
        f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%"
    )
