"""The public plugin API: the ``hookimpl`` marker, the hookspecs, the manager.

A third-party package exposes a module with ``@hookimpl`` functions under the
entry-point group ``pagedllm.plugins``::

    [project.entry-points."pagedllm.plugins"]
    my_plugin = "my_pkg.pagedllm_plugin"

and declares the plugin API range it supports in that module::

    PAGEDLLM_API_VERSION = ">=1.0,<2"

A plugin's own options are a pydantic model it declares there too
(``PAGEDLLM_PLUGIN_CONFIG = MyOptions``, or the ``register_plugin_config``
hook); its components read them with
``get_plugin_manager().plugin_config(MyOptions)`` (plugins/plugin_config.py).

``API_VERSION`` is this pagedllm's plugin API (semver); see plugins/compat.py
and docs/plugins.md ("Compatibility").

Each plugin kind is a :class:`PluginKind` (a str enum: the 1.0 string
literals still work); ``get_plugin_manager().models``,
``.attention_backends``, ... are its typed registries.
"""

from __future__ import annotations

from pagedllm.plugins.compat import API_VERSION, API_VERSION_ATTR, ApiCompatibility, check_api_compatibility
from pagedllm.plugins.hookspecs import PROJECT_NAME, RegisterConfigFn, RegisterFn, hookimpl, hookspec
from pagedllm.plugins.kinds import KIND_SPECS, KindSpec, PluginKind
from pagedllm.plugins.manager import (
    ENTRY_POINT_GROUP,
    KIND_HOOKS,
    KINDS,
    PluginLoadError,
    PluginManager,
    get_plugin_manager,
)
from pagedllm.plugins.metadata import MetadataError
from pagedllm.plugins.registry import Registration, Registry

# The 1.0 names of the kinds, kept as aliases of the enum members.
PLATFORM = PluginKind.PLATFORM
ATTENTION_BACKEND = PluginKind.ATTENTION_BACKEND
MODEL = PluginKind.MODEL
DRAFTER = PluginKind.DRAFTER
GRAMMAR_BACKEND = PluginKind.GRAMMAR_BACKEND
KV_CONNECTOR = PluginKind.KV_CONNECTOR

__all__ = [
    "API_VERSION",
    "API_VERSION_ATTR",
    "ATTENTION_BACKEND",
    "DRAFTER",
    "ENTRY_POINT_GROUP",
    "GRAMMAR_BACKEND",
    "KINDS",
    "KIND_HOOKS",
    "KIND_SPECS",
    "KV_CONNECTOR",
    "MODEL",
    "PLATFORM",
    "PROJECT_NAME",
    "ApiCompatibility",
    "KindSpec",
    "MetadataError",
    "PluginKind",
    "PluginLoadError",
    "PluginManager",
    "RegisterConfigFn",
    "RegisterFn",
    "Registration",
    "Registry",
    "check_api_compatibility",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
