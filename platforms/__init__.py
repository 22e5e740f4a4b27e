"""Platforms: which device kind the engine runs on.

Platforms are a plugin kind (``register_platforms``); ``cpu`` and ``cuda``
are built in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.platforms.interface import Platform

if TYPE_CHECKING:
    from pagedllm.plugins.manager import PluginManager

# "auto" tries these in order. NOTE: out-of-tree platforms are never picked
# by "auto" yet; their precedence rule (a later issue) belongs here.
AUTO_PLATFORM_ORDER: tuple[str, ...] = ("cuda", "cpu")


def load_platform_cls(name: str, plugin_manager: PluginManager | None = None) -> type[Platform]:
    from pagedllm.plugins import get_plugin_manager

    registry = (plugin_manager or get_plugin_manager()).registry("platform")
    platform_cls = registry.load(name)  # UnknownComponentError lists the known names
    if not (isinstance(platform_cls, type) and issubclass(platform_cls, Platform)):
        raise PluginError(
            f"platform {name!r} from {registry.get(name).source} is {platform_cls!r}, "
            "not a Platform subclass"
        )
    return platform_cls


def resolve_platform(name: str = "auto", plugin_manager: PluginManager | None = None) -> Platform:
    """The platform to run on: ``"auto"`` = cuda if available, else cpu; a
    named platform must be registered and available here (ConfigError)."""
    if name == "auto":
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

    registry = (plugin_manager or get_plugin_manager()).registry("platform")
    names = []
    for name in registry.names():
        try:
            if load_platform_cls(name, plugin_manager).is_available():
                names.append(name)
        except PluginError:
            continue
    return ", ".join(["auto", *names])


__all__ = ["AUTO_PLATFORM_ORDER", "Platform", "load_platform_cls", "resolve_platform"]
