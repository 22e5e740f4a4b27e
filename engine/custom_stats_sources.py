"""Which components of an engine core report custom figures
(core/custom_stats.py), found when the engine is built.

The engine core polls what it owns, the KV connector's scheduler side, when
it makes its stats. The ranks' components (every rank's connector worker
side, rank 0's drafter) are polled by their rank after each step, whatever
the executor (worker/worker.py), and their figures come back with the
step's output. A component is a source when its class declares
``custom_metrics``; it must then define ``get_custom_stats()``. The
declarations are checked here (stat_loggers/base.py
``validate_metric_specs``), so a bad name fails the engine's start with a
ConfigError that names the component; those of the ranks' components are
read from their classes (a connector's worker side is the class of its
scheduler side, declared by that one). Rank 0 declares the figures that
depend on the loaded model itself (an MoE model's expert load,
worker/expert_stats.py) when the builder asks it (`model_custom_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.custom_stats import CustomStatsCollector, CustomStatsSource, MetricSpec
from pagedllm.core.errors import ConfigError
from pagedllm.stat_loggers.base import validate_metric_specs

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.plugins.manager import PluginManager


def build_custom_stats(
    config: EngineConfig,
    kv_connector: KVConnectorBase | None,
    plugin_manager: PluginManager,
    model_metrics: Sequence[MetricSpec] = (),
) -> CustomStatsCollector | None:
    """The collector over every source of this engine core (None without
    one): it polls the connector's scheduler side and receives the ranks'
    figures with their step outputs. `model_metrics`: what rank 0 declared
    for its loaded model."""
    polled: list[tuple[str, Any]] = []
    if getattr(kv_connector, "custom_metrics", None):
        polled.append((f"kv_connector {config.kv_transfer.connector!r}", kv_connector))
    declared = [*polled, *_on_ranks(config, plugin_manager)]
    for owner, component in declared:
        if not callable(getattr(component, "get_custom_stats", None)):
            raise ConfigError(
                f"{owner}.get_custom_stats", None,
                "a method returning {name: value}: the component declares custom_metrics",
            )
    if not declared and not model_metrics:
        return None
    specs = validate_metric_specs([
        *((owner, component.custom_metrics) for owner, component in declared),
        *([("the model (rank 0)", model_metrics)] if model_metrics else []),
    ])
    sources: list[tuple[str, CustomStatsSource]] = [(owner, component) for owner, component in polled]
    return CustomStatsCollector(sources, specs)


def _on_ranks(config: EngineConfig, plugin_manager: PluginManager) -> list[tuple[str, Any]]:
    """The classes of the ranks' components not declared by the scheduler
    side: the drafter."""
    method = config.speculative.method
    if method is None:
        return []
    drafter_cls = plugin_manager.drafters.load(method)
    return [(f"drafter {method!r}", drafter_cls)] if getattr(drafter_cls, "custom_metrics", ()) else []
