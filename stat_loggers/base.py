"""The stat-logger interface (vLLM's ``StatLoggerBase``) and the checks of
custom figures' declarations.

A stat logger runs where the requests' outputs are processed: the API
process of ``pagedllm serve`` (AsyncLLM), or the caller's process for
``LLM``. After every batch of engine-core outputs it receives::

    logger.record(scheduler_stats, iteration_stats, num_scheduled_tokens)

- ``scheduler_stats`` (:class:`pagedllm.core.stats.SchedulerStats`, or None
  when only this side had news, e.g. an abort): queue lengths, KV-cache usage,
  prefix-cache, speculative-decoding and KV-connector counts, and the custom
  figures plugins attached (``custom_stats``);
- ``iteration_stats`` (:class:`pagedllm.core.stats.IterationStats`, or
  None when the step produced no outputs): tokens, time to first token,
  inter-token latencies, and ``finished_requests`` (one
  :class:`pagedllm.core.stats.FinishedRequestStats` per finished request);
- ``num_scheduled_tokens``: tokens the step computed (0: an idle stats
  message; None: unknown, e.g. an abort on this side).

``log()`` is called every ``server.log_stats_interval_s`` (never when 0),
``log_engine_initialized()`` once the engine is ready, ``shutdown()`` when the
front end stops.
"""

from __future__ import annotations

import itertools
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.custom_stats import MetricSpec, MetricType
from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.stats import IterationStats, SchedulerStats

# Every metric on /metrics is named `pagedllm:<name>`.
METRIC_PREFIX = "pagedllm:"

# The built-in Prometheus logger's metric names (without the prefix); a custom
# figure may not take one (tests/test_stat_loggers.py checks this list against
# what the built-in registers).
BUILTIN_METRIC_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "prompt_tokens", "generation_tokens", "request_success",
    "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
    "request_params_max_tokens", "request_params_n",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "external_prefix_cache_queries", "external_prefix_cache_hits", "kv_connector_load_failures",
    "kv_connector_tier_blocks", "kv_connector_tier_bytes",
    "cache_config_info", "executor_rank_healthy",
    "router_requests", "router_prefix_routed_requests", "router_predicted_hit_tokens",
    "router_actual_hit_tokens", "replica_healthy",
    "lora_requests_info", "lora_requests", "lora_prompt_tokens", "lora_generation_tokens",
    "lora_adapters_loaded", "lora_load_time_seconds",
})  # fmt: skip

METRIC_NAME_PATTERN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# What the Prometheus exposition appends to a name: a custom name ending so
# would read as another metric's series.
RESERVED_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created", "_info")
MAX_METRIC_NAME_LEN = 128


@dataclass(frozen=True)
class StatLoggerContext:
    """What a stat logger is built with: ``LoggerCls(context)``."""

    model_name: str  # the served model name (the `model_name` label)
    config: EngineConfig | None
    # Where Prometheus collectors go: /metrics serves this registry. A logger
    # that exposes metrics registers them here, never in the global registry.
    registry: CollectorRegistry
    max_model_len: int
    num_kv_blocks: int | None = None
    world_size: int = 1
    # The custom figures the engine core's components declared (READY).
    custom_metrics: tuple[MetricSpec, ...] = field(default_factory=tuple)


class StatLoggerBase(ABC):
    """A stat logger (kind ``stat_logger``), built once per front end as
    ``LoggerCls(context)``."""

    def __init__(self, context: StatLoggerContext) -> None:
        self.context = context

    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        num_scheduled_tokens: int | None = None,
    ) -> None:
        """Account one batch of engine-core outputs (see the module doc)."""

    def log(self, now: float | None = None) -> None:  # noqa: B027 - optional: the default logs nothing
        """Periodic report (every ``server.log_stats_interval_s``); ``now``
        is ``time.monotonic()``-based."""

    def log_engine_initialized(self) -> None:  # noqa: B027 - optional
        """The engine is ready (its KV-cache size is in the context)."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        """The front end stops: flush and close what the logger holds."""


def validate_metric_specs(declared: Iterable[tuple[str, Sequence[MetricSpec]]]) -> list[MetricSpec]:
    """Every ``(owner, custom_metrics)`` checked: legal Prometheus names, not
    a built-in's, not ending like a generated series, buckets ascending, one
    declaration per name (a name declared again identically, e.g. by the two
    sides of one connector, is the same figure). Returns them, de-duplicated;
    ConfigError names the owner, the name and the rule."""
    specs: dict[str, tuple[str, MetricSpec]] = {}
    for owner, owner_specs in declared:
        for spec in owner_specs:
            if not isinstance(spec, MetricSpec):
                raise ConfigError(f"{owner}.custom_metrics", spec, "MetricSpec instances")
            _check_spec(owner, spec)
            first = specs.get(spec.name)
            if first is not None and first[1] != spec:
                raise ConfigError(
                    f"{owner}.custom_metrics", spec.name,
                    f"a name no other component declares ({first[0]} declares {spec.name!r} as {first[1]!r})",
                )
            specs.setdefault(spec.name, (owner, spec))
    return [spec for _, spec in specs.values()]


def _check_spec(owner: str, spec: MetricSpec) -> None:
    key = f"{owner}.custom_metrics"
    name = spec.name
    if not isinstance(name, str) or not METRIC_NAME_PATTERN.fullmatch(name) or len(name) > MAX_METRIC_NAME_LEN:
        raise ConfigError(key, name, f"a Prometheus metric name: [a-zA-Z_][a-zA-Z0-9_]*, at most "
                          f"{MAX_METRIC_NAME_LEN} characters (exposed as {METRIC_PREFIX}<name>)")
    if name in BUILTIN_METRIC_NAMES:
        raise ConfigError(key, name, f"a name no built-in metric has ({METRIC_PREFIX}{name} is built in)")
    if name.endswith(RESERVED_SUFFIXES):
        raise ConfigError(key, name, f"a name not ending in {', '.join(RESERVED_SUFFIXES)} "
                          "(the exposition adds those)")
    if spec.type not in tuple(MetricType):
        raise ConfigError(f"{key}.{name}.type", spec.type, ", ".join(repr(t.value) for t in MetricType))
    if not isinstance(spec.help, str) or not spec.help.strip():
        raise ConfigError(f"{key}.{name}.help", spec.help, "a non-empty help text")
    buckets = spec.buckets
    if buckets is not None:
        if spec.type != MetricType.HISTOGRAM:
            raise ConfigError(f"{key}.{name}.buckets", buckets, "None: only a histogram has buckets")
        if not buckets or any(b >= c for b, c in itertools.pairwise(buckets)):
            raise ConfigError(f"{key}.{name}.buckets", buckets, "a non-empty, strictly ascending list")


__all__ = [
    "BUILTIN_METRIC_NAMES",
    "METRIC_PREFIX",
    "MetricSpec",
    "MetricType",
    "StatLoggerBase",
    "StatLoggerContext",
    "validate_metric_specs",
]
