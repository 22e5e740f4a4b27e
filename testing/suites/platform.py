"""The platform suite: the interface contract and the backend priority list.

The device queries run only where the platform says it is available (a
CUDA platform on a CPU machine has them skipped); the class facts and the
priority list are checked everywhere.
"""

from __future__ import annotations

from typing import Any

from pagedllm.testing.components import load, registration
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "platform"
SUITE = Suite(KIND)


def _available(rule: str, name: str) -> Any:
    cls = load(rule, KIND, name)
    if not cls.is_available():
        raise RuleSkipped(rule, f"platform {name!r} is not available on this machine")
    return cls()


@SUITE.rule("class-facts")
def check_class_facts(name: str) -> None:
    """name, device_type and dist_backend are non-empty strings, device_type
    is the registered one, and is_available() answers a bool without raising."""
    rule = "class-facts"
    cls = load(rule, KIND, name)
    for attribute in ("name", "device_type", "dist_backend"):
        value = getattr(cls, attribute, None)
        if not isinstance(value, str) or not value:
            raise ConformanceError(rule, f"{attribute} is {value!r}, not a non-empty string")
    declared = registration(rule, KIND, name).info.device_type
    if declared is not None and declared != cls.device_type:
        raise ConformanceError(rule, f"registered with device_type={declared!r}, the class says {cls.device_type!r}")
    try:
        available = cls.is_available()
    except Exception as exc:
        raise ConformanceError(rule, f"is_available() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(available, bool):
        raise ConformanceError(rule, f"is_available() returned {available!r}, not a bool")


@SUITE.rule("backend-priority-list")
def check_priority(name: str) -> None:
    """The priority list is a non-empty list of distinct registered attention
    backend names, at least one of which declares the platform's device type."""
    from pagedllm.plugins import get_plugin_manager

    rule = "backend-priority-list"
    cls = load(rule, KIND, name)
    priority = cls().get_attention_backend_priority()
    if not isinstance(priority, list) or not priority or not all(isinstance(n, str) for n in priority):
        raise ConformanceError(rule, f"get_attention_backend_priority() returned {priority!r}")
    if len(set(priority)) != len(priority):
        raise ConformanceError(rule, f"the priority list {priority} names a backend twice")
    backends = get_plugin_manager().attention_backends
    unknown = [n for n in priority if n not in backends]
    if unknown:
        raise ConformanceError(rule, f"the priority list names {unknown}, not registered attention backends "
                                     f"(registered: {', '.join(backends.names())})")

    def runs_on_this_device(backend: str) -> bool:
        device_types = backends.get(backend).info.device_types
        return device_types is None or cls.device_type in device_types

    if not any(runs_on_this_device(backend) for backend in priority):
        raise ConformanceError(rule, f"no backend of {priority} declares device type {cls.device_type!r}")


@SUITE.rule("device-queries")
def check_device_queries(name: str) -> None:
    """On an available platform: a device name, a capability of None or
    (major, minor), float dtypes, 0 <= free <= total memory, device() of its
    device type, and resolve_dtype('auto') among the supported dtypes."""
    import torch

    rule = "device-queries"
    platform = _available(rule, name)
    device_name = platform.get_device_name()
    if not isinstance(device_name, str) or not device_name:
        raise ConformanceError(rule, f"get_device_name() returned {device_name!r}")
    capability = platform.get_device_capability()
    if capability is not None and not (
        len(tuple(capability)) == 2 and all(isinstance(c, int) for c in capability)
    ):
        raise ConformanceError(rule, f"get_device_capability() returned {capability!r}, not None or (major, minor)")
    dtypes = platform.supported_dtypes()
    if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ConformanceError(rule, f"supported_dtypes() returned {dtypes!r}")
    total, free = platform.total_memory_bytes(), platform.free_memory_bytes()
    if not (isinstance(total, int) and isinstance(free, int) and 0 <= free <= total and total > 0):
        raise ConformanceError(rule, f"memory: total {total!r}, free {free!r}; expected 0 <= free <= total, total > 0")
    if platform.device().type != platform.device_type:
        raise ConformanceError(rule, f"device() is {platform.device()}, device_type is {platform.device_type!r}")
    resolved = platform.resolve_dtype("auto", torch.float32)
    if resolved not in dtypes:
        raise ConformanceError(rule, f"resolve_dtype('auto', float32) gave {resolved}, not in {dtypes}")


@SUITE.rule("auto-selects-a-backend")
def check_auto_selection(name: str) -> None:
    """On an available platform, attention_backend=auto chooses a backend of its
    priority list for an ordinary model (head size 64, block size 16)."""
    from pagedllm.attention_backends.selector import select_attention_backend
    from pagedllm.core.errors import AttentionBackendError

    rule = "auto-selects-a-backend"
    platform = _available(rule, name)
    import torch

    dtype = platform.resolve_dtype("auto", torch.float32)
    try:
        selection = select_attention_backend(platform, "auto", head_size=64, dtype=dtype, block_size=16, load=False)
    except AttentionBackendError as exc:
        raise ConformanceError(rule, f"no backend of its priority list runs here: {exc}") from exc
    if selection.name not in platform.get_attention_backend_priority():
        raise ConformanceError(rule, f"auto chose {selection.name!r}, not in the priority list")
