"""pagedllm-example-connector: registers the ``memory_store`` KV connector.

This module is what the entry point names, so pagedllm imports it at start-up
in every process. NOTE: it must stay cheap — the connector class is named as
a "module:Attr" string and imported only when ``kv_transfer.connector``
selects it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterConfigFn, RegisterFn, hookimpl
from pagedllm_example_connector.options import MemoryStoreOptions

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

CONNECTOR_NAME = "memory_store"


@hookimpl
def register_plugin_config(register: RegisterConfigFn) -> None:
    # The plugin's own options (options.py), validated when pagedllm loads it.
    register(MemoryStoreOptions)


@hookimpl
def register_kv_connectors(register: RegisterFn) -> None:
    register(CONNECTOR_NAME, "pagedllm_example_connector.connector:MemoryStoreConnector",
             roles=["producer", "consumer", "both"])
