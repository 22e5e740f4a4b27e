"""The stat-logger manager: runs the selected stat loggers (plugin kind
``stat_logger``, stat_loggers/base.py) side by side and serves ``/metrics``.

Driving it (what AsyncLLM does after each batch of engine-core outputs, and
LLM when it has stat loggers):

    iteration_stats = IterationStats()
    processed = output_processor.process_outputs(outputs, now, iteration_stats=iteration_stats)
    stat_logger.record(scheduler_stats, iteration_stats, num_scheduled_tokens)
    stat_logger.maybe_log()

and `/metrics` serves `stat_logger.render()`. `server.stat_loggers`
(`--stat-loggers a,b`, `LLM(stat_loggers=[...])`) names the loggers; the
server's default is the two built-ins, `prometheus` and `logging`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.plugins import get_plugin_manager
from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext
from pagedllm.stat_loggers.log_line import LoggingStatLogger
from pagedllm.stat_loggers.prometheus import (  # noqa: F401 - re-exported: their home before the stat-logger kind
    DEFAULT_MAX_MODEL_LEN,
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    LABELS,
    N_PARAM_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    PrometheusStatLogger,
    build_1_2_5_buckets,
)

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.custom_stats import MetricSpec
    from pagedllm.core.stats import IterationStats, SchedulerStats

logger = logging.getLogger("pagedllm.metrics")

# What `pagedllm serve` (AsyncLLM) runs when `server.stat_loggers` is not set.
DEFAULT_STAT_LOGGERS = ("prometheus", "logging")

LoggerT = TypeVar("LoggerT", bound=StatLoggerBase)


def stat_logger_names(config: EngineConfig | None, default: Sequence[str] = DEFAULT_STAT_LOGGERS) -> list[str]:
    """The stat loggers `config` selects (`server.stat_loggers`, else
    `default`), each checked against the registry: an unknown name is a
    ConfigError that lists the registered ones. Loads the plugins `config`
    enables first, so a plugin's logger is found in the API process too."""
    plugin_manager = get_plugin_manager()
    if config is not None:
        plugins = config.plugins
        plugin_manager.load(enabled=plugins.enabled, disabled=plugins.disabled, strict=plugins.strict)
    selected = config.server.stat_loggers if config is not None else None
    names = list(dict.fromkeys(default if selected is None else selected))  # in order, once each
    registry = plugin_manager.stat_loggers
    for name in names:
        if name not in registry:
            raise ConfigError(
                "server.stat_loggers", name, "registered stat loggers: " + ", ".join(sorted(registry.names()))
            )
    return names


class StatLoggerManager:
    """The selected stat loggers, fed together.

    `record()` after every engine step; `maybe_log()` as often as convenient
    (it calls every logger's `log()` once per `server.log_stats_interval_s`,
    never when 0); `render()` for the `/metrics` body (served with
    `CONTENT_TYPE`). A logger that raises is logged and skipped for that
    call: a plugin's bug must not stop the outputs.
    """

    CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

    def __init__(
        self,
        model_name: str,
        config: EngineConfig | None = None,
        registry: CollectorRegistry | None = None,
        *,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        world_size: int = 1,
        default_loggers: Sequence[str] = DEFAULT_STAT_LOGGERS,
        custom_metrics: Sequence[MetricSpec] = (),
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # The token-count histograms' buckets reach max_model_len (vLLM).
        if max_model_len is None and config is not None:
            max_model_len = config.model.max_model_len
        context = StatLoggerContext(
            model_name, config, self.registry, max_model_len or DEFAULT_MAX_MODEL_LEN,
            num_kv_blocks=num_kv_blocks, world_size=world_size, custom_metrics=tuple(custom_metrics),
        )  # fmt: skip
        self.loggers: dict[str, StatLoggerBase] = {
            name: _build_logger(name, context) for name in stat_logger_names(config, default_loggers)
        }
        # The built-ins, when selected: the front end feeds router and rank
        # health to the first, tests read the second's line.
        self.prometheus = _first(self.loggers.values(), PrometheusStatLogger)
        self.logging = _first(self.loggers.values(), LoggingStatLogger)
        self.log_interval_s = config.server.log_stats_interval_s if config is not None else 0.0
        self._last_log_time = time.monotonic()
        self._failed: set[tuple[str, str]] = set()
        self.log_engine_initialized()

    @property
    def last_log_time(self) -> float:
        """When `log()` last ran (`time.monotonic()`-based)."""
        return self._last_log_time

    @last_log_time.setter
    def last_log_time(self, value: float) -> None:
        self._last_log_time = value
        if self.logging is not None:
            self.logging.last_log_time = value

    @property
    def interval_generation_tokens(self) -> int:
        """The `logging` logger's generation tokens since its last line."""
        return self.logging.interval_generation_tokens if self.logging is not None else 0

    @interval_generation_tokens.setter
    def interval_generation_tokens(self, value: int) -> None:
        if self.logging is not None:
            self.logging.interval_generation_tokens = value

    def log_engine_initialized(self, num_kv_blocks: int | None = None) -> None:
        """Tell every logger the engine is ready; again with the engine's real
        number of KV blocks (the config's is None when sized from memory)."""
        for name, stat_logger in self.loggers.items():
            if num_kv_blocks is not None:
                stat_logger.context = dataclasses.replace(stat_logger.context, num_kv_blocks=num_kv_blocks)
            self._call(name, stat_logger.log_engine_initialized)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        num_scheduled_tokens: int | None = None,
    ) -> None:
        """Account one engine step in every logger."""
        for name, stat_logger in self.loggers.items():
            self._call(name, stat_logger.record, scheduler_stats, iteration_stats, num_scheduled_tokens)

    def maybe_log(self, now: float | None = None) -> bool:
        """Call every logger's `log()` when the interval has elapsed; True if
        it did. `now` is time.monotonic()-based."""
        if self.log_interval_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_log_time < self.log_interval_s:
            return False
        self.log(now)
        return True

    def log(self, now: float | None = None) -> str:
        """Every logger's periodic report now; returns the `logging` logger's
        line ("" when it is not selected)."""
        now = time.monotonic() if now is None else now
        for name, stat_logger in self.loggers.items():
            self._call(name, stat_logger.log, now)
        self._last_log_time = now
        return self.logging.last_line if self.logging is not None else ""

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's metrics."""
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        for name, stat_logger in self.loggers.items():
            self._call(name, stat_logger.shutdown)

    def _call(self, name: str, method: Callable[..., None], *args: object) -> None:
        try:
            method(*args)
        except Exception:
            # NOTE: logged once per logger and method, then silently skipped:
            # a broken logger would otherwise flood the log every step.
            if (name, method.__name__) not in self._failed:
                self._failed.add((name, method.__name__))
                logger.exception("stat logger %r failed in %s()", name, method.__name__)


def _build_logger(name: str, context: StatLoggerContext) -> StatLoggerBase:
    logger_cls = get_plugin_manager().stat_loggers.load(name)  # a bad target: PluginError naming it
    try:
        return logger_cls(context)
    except Exception as exc:
        raise PluginError(f"stat logger {name!r} failed to start: {type(exc).__name__}: {exc}") from exc


def _first(loggers: Iterable[StatLoggerBase], cls: type[LoggerT]) -> LoggerT | None:
    return next((stat_logger for stat_logger in loggers if isinstance(stat_logger, cls)), None)
