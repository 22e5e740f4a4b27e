"""Building a KV connector: the registered class `kv_transfer.connector`
names, checked against its metadata, with the context of the side it serves.

Every executor alike: each rank builds a worker side over its own KV heads
(worker/worker.py) and the engine builder builds the one scheduler side,
whose context names every rank's shard (`rank_fingerprints`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorContext
    from pagedllm.plugins.manager import PluginManager

logger = logging.getLogger(__name__)


def check_kv_connector_supports(config: EngineConfig, plugin_manager: PluginManager) -> None:
    """A ConfigError, before anything is built, for a connector that does not
    run at this tensor_parallel_size or in this role."""
    transfer = config.kv_transfer
    name = transfer.connector
    if name is None:
        return
    info = plugin_manager.kv_connectors.get(name).info  # UnknownComponentError lists the names
    if info.roles is not None and transfer.role not in info.roles:
        raise ConfigError("kv_transfer.role", transfer.role, f"{', '.join(info.roles)} for connector {name!r}")
    tp_size = config.parallel.tensor_parallel_size
    if tp_size > 1 and not info.supports_tensor_parallel:
        raise ConfigError(
            "kv_transfer.connector", name,
            f"a connector registered with supports_tensor_parallel=True at tensor_parallel_size {tp_size} "
            f"({name!r} does not declare it)",
        )


def build_kv_connector(
    config: EngineConfig, plugin_manager: PluginManager, context: KVConnectorContext
) -> KVConnectorBase:
    """The connector `kv_transfer.connector` names, for `context.side`."""
    name = config.kv_transfer.connector
    if name is None:
        raise ValueError("build_kv_connector: kv_transfer.connector is not set")
    check_kv_connector_supports(config, plugin_manager)
    connector = plugin_manager.kv_connectors.load(name)(config.kv_transfer, context)
    logger.info("kv transfer (%s side, rank %d): %s", context.side, context.tp_rank, connector.describe())
    return connector


__all__ = ["build_kv_connector", "check_kv_connector_supports"]
