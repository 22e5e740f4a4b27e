"""The public plugin API: the ``hookimpl`` marker, the hookspecs, the manager.

A third-party package exposes a module with ``@hookimpl`` functions under the
entry-point group ``pagedllm.plugins``::

    [project.entry-points."pagedllm.plugins"]
    my_plugin = "my_pkg.pagedllm_plugin"
"""

from __future__ import annotations

from pagedllm.plugins.hookspecs import PROJECT_NAME, RegisterFn, hookimpl, hookspec
from pagedllm.plugins.manager import (
    ENTRY_POINT_GROUP,
    KIND_HOOKS,
    KINDS,
    PluginLoadError,
    PluginManager,
    get_plugin_manager,
)
from pagedllm.plugins.registry import Registration, Registry

# Semantic version of the plugin API (hookspecs + register() contract):
# major bumps break plugins, minor bumps add hooks or metadata keys.
API_VERSION = "1.0.0"

PLATFORM = "platform"
ATTENTION_BACKEND = "attention_backend"
MODEL = "model"
DRAFTER = "drafter"
GRAMMAR_BACKEND = "grammar_backend"
KV_CONNECTOR = "kv_connector"

__all__ = [
    "API_VERSION",
    "ATTENTION_BACKEND",
    "DRAFTER",
    "ENTRY_POINT_GROUP",
    "GRAMMAR_BACKEND",
    "KINDS",
    "KIND_HOOKS",
    "KV_CONNECTOR",
    "MODEL",
    "PLATFORM",
    "PROJECT_NAME",
    "PluginLoadError",
    "PluginManager",
    "RegisterFn",
    "Registration",
    "Registry",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
