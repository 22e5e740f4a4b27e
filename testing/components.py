"""Looking up the component under test, for every suite."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import PluginError, UnknownComponentError
from pagedllm.plugins.registry import Registration
from pagedllm.testing.suite import ConformanceError


def registration(rule: str, kind: str, name: str) -> Registration[Any]:
    """The registration of ``name``: entry points loaded, an unknown name a
    ConformanceError of ``rule`` that lists the registered ones."""
    from pagedllm.plugins import get_plugin_manager

    try:
        return get_plugin_manager().registry(kind).get(name)
    except UnknownComponentError as exc:
        raise ConformanceError(rule, str(exc)) from None


def load(rule: str, kind: str, name: str) -> type[Any]:
    """The class registered as ``name`` (imported, checked against the
    kind's interface); a load failure is a ConformanceError of ``rule``."""
    from pagedllm.plugins import get_plugin_manager

    registration(rule, kind, name)
    try:
        return get_plugin_manager().registry(kind).load(name)
    except PluginError as exc:
        raise ConformanceError(rule, str(exc)) from None


def instantiate(rule: str, kind: str, name: str) -> Any:
    """An instance of the class registered as ``name``, built with no
    arguments; a constructor that raises is a ConformanceError of ``rule``."""
    cls = load(rule, kind, name)
    try:
        return cls()
    except Exception as exc:
        raise ConformanceError(rule, f"{name}() raised {type(exc).__name__}: {exc}") from exc
