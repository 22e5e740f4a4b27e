"""Device kernels for the layers' elementwise ops, registered by a platform.

RMSNorm, SwiGLU's SiLU * mul and rotary embedding are written in torch, a
handful of ops each. A platform may register a fused kernel for any of them
(the CPU platform does, platforms/cpu/fused_ops.py) under the op's name below. The
layer calls the kernel first; a kernel returns None for inputs it does not
take (another device, dtype or layout, or while torch.compile traces), and
the layer's torch code runs. A kernel computes what the torch code computes,
to rounding.

Op names and their kernels' signatures:

- "rms_norm": (x, residual | None, weight, eps) -> out | (out, x + residual)
- "silu_and_mul": (gate_up) -> out
- "rotary_embedding": (x [T, heads, head_size], cos, sin) -> x rotated; may
  rotate x in place and return it
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RMS_NORM = "rms_norm"
SILU_AND_MUL = "silu_and_mul"
ROTARY_EMBEDDING = "rotary_embedding"
OP_NAMES = (RMS_NORM, SILU_AND_MUL, ROTARY_EMBEDDING)

_kernels: dict[str, Callable[..., Any]] = {}


def register_op_kernel(name: str, kernel: Callable[..., Any]) -> None:
    """Route op `name` to `kernel` first (process-wide; the last registration wins)."""
    if name not in OP_NAMES:
        raise ValueError(f"unknown layer op {name!r}; known: {', '.join(OP_NAMES)}")
    _kernels[name] = kernel


def unregister_op_kernels() -> None:
    """Every op back to its torch code."""
    _kernels.clear()


def op_kernel(name: str) -> Callable[..., Any] | None:
    return _kernels.get(name)
