"""Which components of an engine core report custom figures
(core/custom_stats.py), found when the engine is built.

The engine-core process holds the KV connector's scheduler side, and, with
an executor that runs its rank in this process (``uni``, the default at
tensor_parallel_size 1), that rank's drafter and the connector's worker
side. A component is a source when its class declares ``custom_metrics``;
it must then define ``get_custom_stats()``. The declarations are checked
here (stat_loggers/base.py ``validate_metric_specs``), so a bad name fails
the engine's start with a ConfigError that names the component.

Ranks in other processes (``mp``, ``ray``) poll their own drafter (the
output rank) and connector worker side (every rank) after each step and send
the figures with the step's output (executors/worker_host.py); the core adds
them to what it polls here. Their declarations are read from the classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.core.custom_stats import CustomStatsCollector, CustomStatsSource
from pagedllm.core.errors import ConfigError
from pagedllm.plugins import get_plugin_manager
from pagedllm.stat_loggers.base import validate_metric_specs

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.executors.base import Executor


def build_custom_stats(config: EngineConfig, executor: Executor) -> CustomStatsCollector | None:
    """The collector over every source of this engine core (None without
    one): it polls those in this process and receives those of ranks in
    other processes with their step outputs (executors/worker_host.py)."""
    polled: list[tuple[str, Any]] = []
    for owner, component in _in_process(config, executor):
        # NOTE: `uni` shares one connector between the scheduler and its rank:
        # polling it twice would count every figure twice.
        if component is None or any(component is seen for _, seen in polled):
            continue
        if getattr(component, "custom_metrics", ()):
            polled.append((owner, component))
    declared = [*polled, *_on_other_ranks(config, executor)]
    for owner, component in declared:
        if not callable(getattr(component, "get_custom_stats", None)):
            raise ConfigError(
                f"{owner}.get_custom_stats", None,
                "a method returning {name: value}: the component declares custom_metrics",
            )
    if not declared:
        return None
    specs = validate_metric_specs((owner, component.custom_metrics) for owner, component in declared)
    sources: list[tuple[str, CustomStatsSource]] = [(owner, component) for owner, component in polled]
    return CustomStatsCollector(sources, specs)


def _in_process(config: EngineConfig, executor: Executor) -> list[tuple[str, Any]]:
    connector = config.kv_transfer.connector
    candidates: list[tuple[str, Any]] = [(f"kv_connector {connector!r}", executor.kv_connector)]
    worker = getattr(executor, "driver_worker", None)  # an in-process rank (uni)
    if worker is not None:
        candidates.append((f"kv_connector {connector!r} (worker side)", getattr(worker, "kv_connector", None)))
        candidates.append((f"drafter {config.speculative.method!r}", getattr(worker, "drafter", None)))
    return candidates


def _on_other_ranks(config: EngineConfig, executor: Executor) -> list[tuple[str, Any]]:
    """The classes of the components that run on ranks in other processes
    and are not polled here: the drafter (a connector's worker side is the
    class of its scheduler side, declared by that one)."""
    method = config.speculative.method
    if getattr(executor, "driver_worker", None) is not None or method is None:
        return []
    drafter_cls = get_plugin_manager().drafters.load(method)
    return [(f"drafter {method!r}", drafter_cls)] if getattr(drafter_cls, "custom_metrics", ()) else []
