"""Platforms: which device kind the engine runs on.

Platforms are a plugin kind (``register_platforms``); ``cpu`` and ``cuda``
are built in. ``"auto"`` follows vLLM's rule for out-of-tree platforms: a
plugin platform that reports itself available wins over the built-ins; two
available at once is an error naming both (the user picks one by name).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.platforms.interface import DeviceCommunicator, Platform, TorchDistributedCommunicator

if TYPE_CHECKING:
    from pagedllm.plugins.manager import PluginManager

logger = logging.getLogger(__name__)

# "auto" tries these built-ins in order when no out-of-tree platform is available.
AUTO_PLATFORM_ORDER: tuple[str, ...] = ("cuda", "cpu")


def load_platform_cls(name: str, plugin_manager: PluginManager | None = None) -> type[Platform]:
    from pagedllm.plugins import get_plugin_manager

    # UnknownComponentError lists the known names; the registry checks the Platform base.
    return (plugin_manager or get_plugin_manager()).platforms.load(name)


def available_out_of_tree_platforms(plugin_manager: PluginManager | None = None) -> list[tuple[str, str]]:
    """(name, source) of every platform registered by a plugin (not builtin)
    whose ``is_available()`` is true in this process.

    A plugin platform that cannot even be imported is logged and left out:
    "auto" must not fail because of a platform nobody asked for by name.
    """
    from pagedllm.plugins import get_plugin_manager
    from pagedllm.plugins.registry import BUILTIN_SOURCE

    registry = (plugin_manager or get_plugin_manager()).platforms
    available = []
    for registration in registry.registrations():
        if registration.source == BUILTIN_SOURCE:
            continue
        try:
            platform_cls = load_platform_cls(registration.name, plugin_manager)
            is_available = platform_cls.is_available()
        except Exception as exc:  # NOTE: a broken plugin platform must not break "auto"
            logger.warning(
                "platform %r from %s is skipped by platform=auto: %s: %s",
                registration.name, registration.source, type(exc).__name__, exc,
            )
            continue
        if is_available:
            available.append((registration.name, registration.source))
    return available


def resolve_platform(name: str = "auto", plugin_manager: PluginManager | None = None) -> Platform:
    """The platform to run on; a named platform must be registered and
    available here (ConfigError).

    ``"auto"`` (vLLM's rule): exactly one available out-of-tree platform wins
    over the built-ins; two or more available is a ConfigError naming each
    (select one with ``device.platform``, or disable the other plugin); none:
    the first available of AUTO_PLATFORM_ORDER (cuda, then cpu).
    """
    if name == "auto":
        out_of_tree = available_out_of_tree_platforms(plugin_manager)
        if len(out_of_tree) > 1:
            listed = ", ".join(f"{platform_name} (from {source})" for platform_name, source in out_of_tree)
            raise ConfigError(
                "platform",
                name,
                f"at most one available out-of-tree platform, but {len(out_of_tree)} are available: {listed}; "
                "name one with device.platform, or disable the others with plugins.disabled",
            )
        if out_of_tree:
            platform_name, source = out_of_tree[0]
            logger.info("platform=auto: out-of-tree platform %r from %s is available and wins", platform_name, source)
            return load_platform_cls(platform_name, plugin_manager)()
        for candidate in AUTO_PLATFORM_ORDER:
            platform_cls = load_platform_cls(candidate, plugin_manager)
            if platform_cls.is_available():
                return platform_cls()
        raise ConfigError("platform", name, "no platform is available")  # cpu always is
    platform_cls = load_platform_cls(name, plugin_manager)
    if not platform_cls.is_available():
        raise ConfigError("platform", name, f"a platform available on this machine ({_available(plugin_manager)})")
    return platform_cls()


def _available(plugin_manager: PluginManager | None) -> str:
    from pagedllm.plugins import get_plugin_manager

    registry = (plugin_manager or get_plugin_manager()).platforms
    names = []
    for name in registry.names():
        try:
            if load_platform_cls(name, plugin_manager).is_available():
                names.append(name)
        except PluginError:
            continue
    return ", ".join(["auto", *names])


__all__ = [
    "AUTO_PLATFORM_ORDER",
    "DeviceCommunicator",
    "Platform",
    "TorchDistributedCommunicator",
    "available_out_of_tree_platforms",
    "load_platform_cls",
    "resolve_platform",
]
