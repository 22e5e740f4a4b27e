"""A small typed registry per plugin kind: name -> lazy target.

``Registry[T, InfoT]`` loads subclasses of ``T`` (the kind's interface,
checked once per target) and holds each registration's metadata as an
``InfoT`` (built and checked when ``register`` was called).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from pagedllm.core.errors import PluginError, UnknownComponentError
from pagedllm.plugins.hookspecs import Target

BUILTIN_SOURCE = "builtin"

T = TypeVar("T")
InfoT = TypeVar("InfoT")


@dataclass(frozen=True)
class Registration(Generic[InfoT]):
    """One ``register(name, target, **metadata)`` call, and who made it."""

    kind: str
    name: str
    target: Target
    source: str  # "builtin", "<distribution> <version>", or the pm.register name
    metadata: dict[str, Any] = field(default_factory=dict)  # the keywords as given (API 1.0)
    info: InfoT = field(kw_only=True)  # the same keywords as the kind's typed value
    # The pluggy name of the plugin that registered it (its options:
    # PluginManager.component_config); None for a registration built by hand.
    plugin: str | None = field(default=None, kw_only=True)

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


class Registry(Generic[T, InfoT]):
    """Registrations of one kind, filled by the plugin manager from the hooks.

    ``interface``: ``"module:Class"`` that every loaded target must subclass
    (None: no check).
    """

    def __init__(self, kind: str, interface: str | None = None) -> None:
        self.kind = kind
        self.interface = interface
        self._registrations: dict[str, Registration[InfoT]] = {}
        self._loaded: dict[str, type[T]] = {}
        # An old name that still selects a renamed registration: alias -> (name, source).
        self._aliases: dict[str, tuple[str, str]] = {}

    def add(self, registration: Registration[InfoT]) -> None:
        self._check_free(registration.name, registration.source)
        self._registrations[registration.name] = registration

    def add_alias(self, alias: str, name: str, source: str) -> None:
        """`alias` selects the registration `name` too (its name before a rename)."""
        self._check_free(alias, source)
        self._aliases[alias] = (name, source)

    def _check_free(self, name: str, source: str) -> None:
        existing = self._registrations.get(name)
        existing_source = existing.source if existing is not None else self._aliases.get(name, (None, None))[1]
        if existing_source is not None:
            raise PluginError(f"{self.kind} {name!r} registered by {existing_source} and by {source}")

    def canonical(self, name: str) -> str:
        """The registered name `name` stands for (itself unless it is an alias)."""
        return self._aliases[name][0] if name in self._aliases else name

    def aliases(self) -> dict[str, str]:
        """alias -> the registered name it selects."""
        return {alias: name for alias, (name, _) in self._aliases.items()}

    def get(self, name: str) -> Registration[InfoT]:
        try:
            return self._registrations[self.canonical(name)]
        except KeyError:
            raise UnknownComponentError(self.kind, name, self.names()) from None

    def load(self, name: str) -> type[T]:
        """The registered class: imported (or built by its factory) once,
        checked against the kind's interface, then cached.

        A class target is returned as is; any other callable is a factory
        that returns the class.
        """
        name = self.canonical(name)
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
        checked = self._check_interface(registration, obj)
        self._loaded[name] = checked
        return checked

    def _check_interface(self, registration: Registration[InfoT], obj: Any) -> type[T]:
        if self.interface is None or (isinstance(obj, type) and issubclass(obj, import_target(self.interface))):
            return cast("type[T]", obj)
        raise PluginError(
            f"{self.kind} {registration.name!r} from {registration.target_str} "
            f"(registered by {registration.source}) is {obj!r}, not a subclass of {self.interface}"
        )

    def names(self) -> list[str]:
        return list(self._registrations)

    def registrations(self) -> list[Registration[InfoT]]:
        return list(self._registrations.values())

    def __contains__(self, name: object) -> bool:
        return name in self._registrations or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._registrations)

    def __len__(self) -> int:
        return len(self._registrations)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
