"""Which components of an engine core report custom figures
(core/custom_stats.py), found when the engine is built.

The engine-core process holds the KV connector's scheduler side, and, with
an executor that runs its rank in this process (``uni``, the default at
tensor_parallel_size 1), that rank's drafter and the connector's worker
side. A component is a source when its class declares ``custom_metrics``;
it must then define ``get_custom_stats()``. The declarations are checked
here (stat_loggers/base.py ``validate_metric_specs``), so a bad name fails
the engine's start with a ConfigError that names the component.

NOTE: ranks in other processes (``mp``, ``ray``) do not send figures yet;
their drafters' and connectors' worker sides are not polled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.custom_stats import CustomStatsCollector, CustomStatsSource
from pagedllm.core.errors import ConfigError
from pagedllm.stat_loggers.base import validate_metric_specs

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.executors.base import Executor


def build_custom_stats(config: EngineConfig, executor: Executor) -> CustomStatsCollector | None:
    """The collector over every source of this engine core; None without one."""
    sources: list[tuple[str, Any]] = []
    for owner, component in _candidates(config, executor):
        # NOTE: `uni` shares one connector between the scheduler and its rank:
        # polling it twice would count every figure twice.
        if component is None or any(component is seen for _, seen in sources):
            continue
        if getattr(component, "custom_metrics", ()):
            sources.append((owner, component))
    for owner, component in sources:
        if not callable(getattr(component, "get_custom_stats", None)):
            raise ConfigError(
                f"{owner}.get_custom_stats", None,
                "a method returning {name: value}: the component declares custom_metrics",
            )
    if not sources:
        return None
    validate_metric_specs((owner, component.custom_metrics) for owner, component in sources)
    checked: list[tuple[str, CustomStatsSource]] = [(owner, component) for owner, component in sources]
    return CustomStatsCollector(checked)


def _candidates(config: EngineConfig, executor: Executor) -> list[tuple[str, Any]]:
    connector = config.kv_transfer.connector
    method = config.speculative.method
    candidates: list[tuple[str, Any]] = [(f"kv_connector {connector!r}", executor.kv_connector)]
    worker = getattr(executor, "driver_worker", None)  # an in-process rank (uni)
    if worker is not None:
        candidates.append((f"kv_connector {connector!r} (worker side)", getattr(worker, "kv_connector", None)))
        candidates.append((f"drafter {method!r}", getattr(worker, "drafter", None)))
    return candidates
