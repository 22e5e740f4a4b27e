"""Deprecated (plugin API 1.x): process-wide op kernels.

Use `Platform.register_layer_ops(register)` (model_registry/layers/ops.py)
instead. A kernel registered here is still offered, under the name
"legacy", to every op registry built after the call, below every
implementation registered the new way; it no longer changes a layer that is
already bound.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from pagedllm.model_registry.layers.ops import LEGACY_KERNELS, OP_NAMES, RMS_NORM, ROTARY_EMBEDDING, SILU_AND_MUL

__all__ = ["OP_NAMES", "RMS_NORM", "ROTARY_EMBEDDING", "SILU_AND_MUL", "register_op_kernel",
           "unregister_op_kernels"]


def register_op_kernel(name: str, kernel: Callable[..., Any]) -> None:
    """Offer `kernel` for op `name` to op registries built from now on."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown layer op {name!r}; known: {', '.join(OP_NAMES)}")
    warnings.warn("register_op_kernel is deprecated: register the kernel in Platform.register_layer_ops",
                  DeprecationWarning, stacklevel=2)
    LEGACY_KERNELS[name] = kernel


def unregister_op_kernels() -> None:
    LEGACY_KERNELS.clear()
