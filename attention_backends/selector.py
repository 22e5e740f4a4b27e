"""Attention backend selection from registration metadata alone.

Rule (DESIGN.md): a configured backend is validated alone and is an error,
with every reason, if it cannot run here (never a silent fallback); "auto"
takes the first backend of the platform's priority list with no reason
against it. Only the chosen backend's module is ever imported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import AttentionBackendError, PluginError
from pagedllm.platforms.interface import dtype_name

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionBackend, AttentionCapabilities, AttentionRequirements
    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.manager import PluginManager
    from pagedllm.plugins.registry import Registration, Registry


@dataclass(frozen=True)
class BackendSelection:
    name: str
    registration: Registration[AttentionCapabilities]
    # backend name -> why it cannot run here (every backend that was checked and failed)
    rejected: dict[str, list[str]] = field(default_factory=dict)
    _registry: Registry[AttentionBackend, AttentionCapabilities] | None = field(default=None, repr=False, compare=False)

    @property
    def backend_cls(self) -> type[AttentionBackend]:
        """The chosen backend class, imported on first access."""
        if self._registry is None:
            raise PluginError(f"attention backend {self.name!r} has no registry to load from")
        return self._registry.load(self.name)


def _is_importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing
        return False


def _fmt_capability(capability: tuple[int, int]) -> str:
    major, minor = capability
    return f"{major}.{minor}"


def check_backend(
    registration: Registration[AttentionCapabilities],
    platform: Platform,
    *,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    sliding_window: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    requirements: AttentionRequirements | None = None,
) -> list[str]:
    """Every reason the backend cannot run this configuration here ([] = it
    can). `kv_cache_dtype`: what the KV cache stores (None = `dtype`).
    `requirements`: what the model's layers ask (every layer's head size,
    a window, a soft cap, sinks), checked against the capabilities."""
    caps = registration.info
    reasons = _device_reasons(caps, platform)
    name_of_dtype = dtype_name(dtype)
    if caps.dtypes is not None and name_of_dtype not in caps.dtypes:
        reasons.append(f"dtype {name_of_dtype} is not supported (supports {', '.join(caps.dtypes)})")
    if dtype not in platform.supported_dtypes():
        reasons.append(f"dtype {name_of_dtype} is not supported by {platform.describe()}")
    if kv_cache_dtype is not None and kv_cache_dtype != dtype:
        reasons += _kv_cache_dtype_reasons(caps, platform, dtype_name(kv_cache_dtype))

    # NOTE: head-size limits are the per-head K/V kernels'; a latent (MLA)
    # model's "head size" is its latent width, which `supports_mla` covers.
    if requirements is None or requirements.latent_kv_size is None:
        head_sizes = dict.fromkeys((head_size, *(requirements.head_sizes if requirements else ())))
        for size in head_sizes:  # every layer's, each named once
            reasons += _head_size_reasons(caps, size)
    if caps.block_size_multiple is not None and block_size % caps.block_size_multiple != 0:
        reasons.append(f"block size {block_size} is not a multiple of {caps.block_size_multiple}")
    if requirements is not None:
        reasons += _requirement_reasons(caps, requirements, sliding_window)
    elif sliding_window is not None and not caps.supports_sliding_window:
        reasons.append(f"sliding window ({sliding_window}) is not supported")
    for package in caps.requires:
        if not _is_importable(package):
            reasons.append(f"package {package!r} is not installed")
    return reasons


def _head_size_reasons(caps: AttentionCapabilities, head_size: int) -> list[str]:
    reasons = []
    if caps.head_sizes is not None and head_size not in caps.head_sizes:
        reasons.append(f"head size {head_size} is not supported (supports {', '.join(map(str, caps.head_sizes))})")
    if caps.head_size_multiple is not None and head_size % caps.head_size_multiple != 0:
        reasons.append(f"head size {head_size} is not a multiple of {caps.head_size_multiple}")
    if caps.max_head_size is not None and head_size > caps.max_head_size:
        reasons.append(f"head size {head_size} > {caps.max_head_size} maximum")
    return reasons


def _requirement_reasons(
    caps: AttentionCapabilities, requirements: AttentionRequirements, sliding_window: int | None
) -> list[str]:
    """The model's features the backend does not declare."""
    reasons = []
    window = requirements.sliding_window if requirements.sliding_window is not None else sliding_window
    if window is not None and not caps.supports_sliding_window:
        reasons.append(f"sliding window ({window}) is not supported")
    if requirements.logits_soft_cap is not None and not caps.supports_logits_soft_cap:
        reasons.append(f"attention logit soft cap ({requirements.logits_soft_cap:g}) is not supported")
    if requirements.sinks and not caps.supports_sinks:
        reasons.append("attention sinks are not supported")
    if requirements.latent_kv_size is not None and not caps.supports_mla:
        reasons.append("latent attention (MLA) is not supported")
    return reasons


def _kv_cache_dtype_reasons(caps: AttentionCapabilities, platform: Platform, cache_dtype: str) -> list[str]:
    if cache_dtype not in caps.kv_cache_dtypes:
        stores = ", ".join(caps.kv_cache_dtypes) if caps.kv_cache_dtypes else "none besides the compute dtype"
        return [f"KV cache dtype {cache_dtype} is not supported (cache dtypes: {stores})"]
    needed = dict(caps.kv_cache_dtype_min_capability).get(cache_dtype)
    capability = platform.get_device_capability()
    if needed is not None and capability is not None and tuple(capability) < needed:
        return [f"KV cache dtype {cache_dtype} needs compute capability >= {_fmt_capability(needed)} "
                f"(have {_fmt_capability(capability)})"]
    return []


def _device_reasons(caps: AttentionCapabilities, platform: Platform) -> list[str]:
    if caps.device_types is not None and platform.device_type not in caps.device_types:
        return [f"device type {platform.device_type!r} is not supported (needs {', '.join(caps.device_types)})"]
    capability = platform.get_device_capability()
    if capability is None:
        return []
    reasons = []
    have = _fmt_capability(capability)
    if caps.min_capability is not None and tuple(capability) < caps.min_capability:
        reasons.append(f"compute capability {have} < {_fmt_capability(caps.min_capability)} required")
    if caps.max_capability is not None and tuple(capability) > caps.max_capability:
        reasons.append(f"compute capability {have} > {_fmt_capability(caps.max_capability)} supported")
    return reasons


def select_attention_backend(
    platform: Platform,
    requested: str = "auto",
    *,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    sliding_window: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    requirements: AttentionRequirements | None = None,
    load: bool = True,
    plugin_manager: PluginManager | None = None,
) -> BackendSelection:
    """Pick the attention backend; ``load=False`` leaves the import for later
    (``pagedllm env`` reports without importing any backend). `kv_cache_dtype`
    is what the KV cache stores (None = `dtype`): a backend that does not
    declare it in ``kv_cache_dtypes`` is rejected. `requirements`: what the
    model's attention layers ask (`AttentionRequirements`); a backend that
    lacks a capability they need is rejected with that reason."""
    from pagedllm.plugins import get_plugin_manager

    registry = (plugin_manager or get_plugin_manager()).attention_backends
    checks: dict[str, Any] = dict(
        head_size=head_size, dtype=dtype, block_size=block_size, sliding_window=sliding_window,
        kv_cache_dtype=kv_cache_dtype, requirements=requirements,
    )

    if requested != "auto":
        registration = registry.get(requested)  # UnknownComponentError lists the known names
        reasons = check_backend(registration, platform, **checks)
        if reasons:
            raise AttentionBackendError(requested, reasons)
        # An alias (a renamed backend's old name) reports the backend's name.
        selection = BackendSelection(registration.name, registration, {}, registry)
    else:
        rejected: dict[str, list[str]] = {}
        chosen: Registration[AttentionCapabilities] | None = None
        for name in platform.get_attention_backend_priority():
            if name not in registry:
                rejected[name] = ["not registered by any plugin"]
                continue
            reasons = check_backend(registry.get(name), platform, **checks)
            if reasons:
                rejected[name] = reasons
            else:
                chosen = registry.get(name)
                break
        if chosen is None:
            raise AttentionBackendError(
                "auto", [f"{name}: {'; '.join(reasons)}" for name, reasons in rejected.items()]
            )
        selection = BackendSelection(chosen.name, chosen, rejected, registry)

    if load:
        selection.backend_cls  # noqa: B018 - import now so a broken backend fails at start-up
    return selection


__all__ = ["BackendSelection", "check_backend", "select_attention_backend"]
