"""The public plugin API: the ``hookimpl`` marker, the hookspecs, the manager.

A third-party package exposes a module with ``@hookimpl`` functions under the
entry-point group ``pagedllm.plugins``::

    [project.entry-points."pagedllm.plugins"]
    my_plugin = "my_pkg.pagedllm_plugin"

and declares the plugin API range it supports in that module::

    PAGEDLLM_API_VERSION = ">=1.0,<2"

``API_VERSION`` is this pagedllm's plugin API (semver); see plugins/compat.py
and docs/plugins.md ("Compatibility").
"""

from __future__ import annotations

from pagedllm.plugins.compat import API_VERSION, API_VERSION_ATTR, ApiCompatibility, check_api_compatibility
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

PLATFORM = "platform"
ATTENTION_BACKEND = "attention_backend"
MODEL = "model"
DRAFTER = "drafter"
GRAMMAR_BACKEND = "grammar_backend"
KV_CONNECTOR = "kv_connector"

__all__ = [
    "API_VERSION",
    "API_VERSION_ATTR",
    "ApiCompatibility",
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
    "check_api_compatibility",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
