"""A small typed registry per plugin kind: name -> lazy target."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from pagedllm.core.errors import PluginError, UnknownComponentError
from pagedllm.plugins.hookspecs import Target

BUILTIN_SOURCE = "builtin"


@dataclass(frozen=True)
class Registration:
    """One ``register(name, target, **metadata)`` call, and who made it."""

    kind: str
    name: str
    target: Target
    source: str  # "builtin", "<distribution> <version>", or the pm.register name
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def target_str(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{getattr(self.target, '__module__', '?')}:{getattr(self.target, '__qualname__', repr(self.target))}"


def import_target(target: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"target {target!r} is not of the form 'package.module:Attr'")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


class Registry:
    """Registrations of one kind, filled by the plugin manager from the hooks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._registrations: dict[str, Registration] = {}
        self._loaded: dict[str, Any] = {}

    def add(self, registration: Registration) -> None:
        existing = self._registrations.get(registration.name)
        if existing is not None:
            raise PluginError(
                f"{self.kind} {registration.name!r} registered by {existing.source} "
                f"and by {registration.source}"
            )
        self._registrations[registration.name] = registration

    def get(self, name: str) -> Registration:
        try:
            return self._registrations[name]
        except KeyError:
            raise UnknownComponentError(self.kind, name, self.names()) from None

    def load(self, name: str) -> Any:
        """The registered object: imported (or built by its factory) once, then cached.

        A class target is returned as is; any other callable is a factory.
        """
        if name in self._loaded:
            return self._loaded[name]
        registration = self.get(name)
        target = registration.target
        try:
            if isinstance(target, str):
                obj = import_target(target)
            elif isinstance(target, type):
                obj = target
            else:
                obj = target()
        except Exception as exc:
            raise PluginError(
                f"cannot load {self.kind} {name!r} from {registration.target_str} "
                f"(registered by {registration.source}): {type(exc).__name__}: {exc}"
            ) from exc
        self._loaded[name] = obj
        return obj

    def names(self) -> list[str]:
        return list(self._registrations)

    def registrations(self) -> list[Registration]:
        return list(self._registrations.values())

    def __contains__(self, name: object) -> bool:
        return name in self._registrations

    def __iter__(self) -> Iterator[str]:
        return iter(self._registrations)

    def __len__(self) -> int:
        return len(self._registrations)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
