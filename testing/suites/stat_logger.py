"""Conformance suite of the ``stat_logger`` kind (stat_loggers/base.py).

Each rule builds the logger the way the front end does, ``LoggerCls(context)``
with a fresh Prometheus registry and one custom figure of each type, and
feeds it what an engine can send: full and empty scheduler stats, iteration
stats with finished requests, an abort (scheduler stats None), an idle
heartbeat (0 tokens), custom figures it declared and one it did not.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pagedllm.testing.suite import ConformanceError, Suite

if TYPE_CHECKING:
    from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext

SUITE = Suite("stat_logger")


def _in_scratch_dir(check: Callable[[str], None]) -> Callable[[str], None]:
    """Run a rule in a fresh temporary working directory: a logger that
    writes files (the jsonl example's default path is relative) leaves none
    in the directory the suite was started from."""

    @functools.wraps(check)
    def run(name: str) -> None:
        with tempfile.TemporaryDirectory(prefix="pagedllm-conformance-") as scratch, contextlib.chdir(scratch):
            check(name)

    return run


def _context() -> StatLoggerContext:
    from prometheus_client import CollectorRegistry

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.custom_stats import MetricSpec, MetricType
    from pagedllm.stat_loggers.base import StatLoggerContext

    return StatLoggerContext(
        "conformance-model", EngineConfig(), CollectorRegistry(auto_describe=True), 256,
        num_kv_blocks=32, world_size=1,
        custom_metrics=(
            MetricSpec("conformance_counter", MetricType.COUNTER, "A counter."),
            MetricSpec("conformance_gauge", MetricType.GAUGE, "A gauge."),
            MetricSpec("conformance_histogram", MetricType.HISTOGRAM, "A histogram.", buckets=[1.0, 10.0]),
        ),
    )  # fmt: skip


def _build(rule: str, name: str, context: StatLoggerContext | None = None) -> StatLoggerBase:
    from pagedllm.plugins import get_plugin_manager
    from pagedllm.stat_loggers.base import StatLoggerBase

    try:
        logger_cls = get_plugin_manager().stat_loggers.load(name)
        stat_logger = logger_cls(context if context is not None else _context())
    except Exception as exc:
        raise ConformanceError(rule, f"LoggerCls(context) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(stat_logger, StatLoggerBase):
        raise ConformanceError(rule, f"{type(stat_logger).__name__} is not a StatLoggerBase")
    return stat_logger


@contextlib.contextmanager
def _broken_if_raises(rule: str, what: str) -> Iterator[None]:
    try:
        yield
    except ConformanceError:
        raise
    except Exception as exc:
        raise ConformanceError(rule, f"{what} raised {type(exc).__name__}: {exc}") from exc


def _steps() -> list[tuple[object, object, int | None, str]]:
    """(scheduler_stats, iteration_stats, num_scheduled_tokens, description) an engine can send."""
    from pagedllm.core.stats import FinishedRequestStats, IterationStats, SchedulerStats, SpecDecodingStats
    from pagedllm.kv_connectors.base import KVConnectorStats

    full = SchedulerStats(
        2, 1, 0.25, 32, 16, 0, spec_decoding_stats=SpecDecodingStats(2, 1, 2, 1, [1, 0]),
        kv_connector_stats=KVConnectorStats(), custom_stats={
            "conformance_counter": 3.0, "conformance_gauge": 0.5, "conformance_histogram": [0.5, 4.0],
        },
    )  # fmt: skip
    finished = FinishedRequestStats("length", 1.0, 8, 4, 4, 0.1, 0.2, 0.9, 0.7, 0.7 / 3)
    iteration = IterationStats(
        num_prompt_tokens=8, num_generation_tokens=4, time_to_first_tokens=[0.3], inter_token_latencies=[0.1],
        finished_requests=[finished], n_params=[1],
    )  # fmt: skip
    aborted = IterationStats(finished_requests=[FinishedRequestStats("abort", 0.5, 8, 0, None, 0.5, 0, 0, 0, None)])
    undeclared = SchedulerStats(0, 0, 0.0, 0, 0, 0, custom_stats={"not_declared": 1.0})
    return [
        (full, iteration, 12, "a step with every stats field set"),
        (SchedulerStats(0, 0, 0.0, 0, 0, 0), None, 0, "an idle heartbeat (no outputs, 0 tokens)"),
        (None, aborted, None, "an abort seen on the API side (no scheduler stats)"),
        (undeclared, None, 0, "a custom figure that was not declared"),
    ]


@SUITE.rule("builds-from-context")
@_in_scratch_dir
def check_builds(name: str) -> None:
    """``LoggerCls(context)`` works and gives a StatLoggerBase."""
    _build("builds-from-context", name)


@SUITE.rule("records-every-stats-shape")
@_in_scratch_dir
def check_records(name: str) -> None:
    """``record`` accepts everything an engine sends, ``None`` parts included."""
    rule = "records-every-stats-shape"
    stat_logger = _build(rule, name)
    for scheduler_stats, iteration_stats, num_tokens, description in _steps():
        with _broken_if_raises(rule, f"record() of {description}"):
            stat_logger.record(scheduler_stats, iteration_stats, num_tokens)  # type: ignore[arg-type]


@SUITE.rule("lifecycle")
@_in_scratch_dir
def check_lifecycle(name: str) -> None:
    """``log_engine_initialized``, ``log`` (before and after records) and
    ``shutdown`` (twice: the front end may stop twice) do not raise."""
    rule = "lifecycle"
    stat_logger = _build(rule, name)
    with _broken_if_raises(rule, "log_engine_initialized()"):
        stat_logger.log_engine_initialized()
    with _broken_if_raises(rule, "log() before any record"):
        stat_logger.log(0.0)
    scheduler_stats, iteration_stats, num_tokens, _ = _steps()[0]
    stat_logger.record(scheduler_stats, iteration_stats, num_tokens)  # type: ignore[arg-type]
    with _broken_if_raises(rule, "log() after a record"):
        stat_logger.log(10.0)
    with _broken_if_raises(rule, "shutdown()"):
        stat_logger.shutdown()
        stat_logger.shutdown()


@SUITE.rule("own-registry-only")
@_in_scratch_dir
def check_registry(name: str) -> None:
    """Two loggers in one process do not collide, and none registers a
    collector in prometheus_client's global registry (several engines, and
    tests, share a process): metrics go in ``context.registry``."""
    import prometheus_client

    rule = "own-registry-only"
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    first = _build(rule, name)
    second = _build(rule, name)
    added = sorted(set(prometheus_client.REGISTRY._names_to_collectors) - before)
    for stat_logger in (first, second):
        stat_logger.shutdown()
    if added:
        raise ConformanceError(rule, f"it registered {added} in the global prometheus_client.REGISTRY")
