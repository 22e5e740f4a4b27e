"""The CPU platform's fused kernels for the layers' elementwise ops.

RMSNorm with its residual add, SiLU * mul and rotary embedding, from
csrc/cpu_ops.c (built on first use, platforms/cpu/kernel_build.py), are the
CPU platform's implementations of those layer ops
(`CpuPlatform.register_layer_ops`; the registry is
model_registry/layers/ops.py). On the ~100M Llama in bfloat16 these
ops took a quarter of a prefill step in torch, where each is several passes
over memory with a float32 round trip per element; on a small float32 model
at decode they are a string of tiny ops whose dispatch costs more than their
arithmetic. `PAGEDLLM_CPU_FUSED_OPS=0` keeps the torch code.

Each kernel takes float32 or bfloat16 CPU tensors whose last dimension is
contiguous, and returns None otherwise (and while torch.compile traces: a
ctypes call cannot be traced), so the layer's torch code runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.platforms.cpu.graph import kernel_call
from pagedllm.platforms.cpu.kernel_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
# -ffp-contract=off: a fused multiply-add rounds differently from torch's ops.
# -fno-trapping-math lets floorf (in exp) vectorise; it changes no result.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp",
          "-ffp-contract=off", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_FUSED_OPS"
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32],
    "silu_and_mul": [_INT, _PTR, _I64, _PTR, _I64, _I64, _I64],
    "rotary_embedding": [_INT, _PTR, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _PTR, _I64],
}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU fused layer ops")
    if library is not None:
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = None, argtypes
    return library


def _takes(*tensors: torch.Tensor) -> bool:
    # is_cpu, not device.type == "cpu": this runs for every op of every layer
    # and building the three device objects took 0.8 of its 2 us.
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(t.is_cpu and t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


def _library() -> ctypes.CDLL | None:
    """The library, or None while torch.compile traces (it cannot trace a
    ctypes call; checked first, so that it does not trace the loader either)."""
    return None if torch.compiler.is_compiling() else load()


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm(x) * weight, or with `residual`: (that of x + residual, x + residual).
    x [T, heads, D] without a residual (Qwen3's q/k norms, per head): as
    [T * heads, D] rows, copied first where its rows are not evenly strided
    (a slice of a fused qkv): two recorded operations in a decode graph
    instead of the torch code's eight."""
    library = _library()
    if x.dim() == 3 and residual is None and library is not None and x.stride(2) == 1:
        out = rms_norm(x.reshape(-1, x.shape[2]), None, weight, eps)
        return None if out is None else out.view(x.shape)  # type: ignore[union-attr]
    operands = (x, weight) if residual is None else (x, weight, residual)
    if library is None or x.dim() != 2 or not _takes(*operands):
        return None
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    summed = None if residual is None else torch.empty(rows, hidden, dtype=x.dtype)
    residual_stride = 0 if residual is None else residual.stride(0)
    kernel_call(library.rms_norm, KERNEL_DTYPES[x.dtype], x, x.stride(0), residual, residual_stride, summed, weight,
                out, rows, hidden, eps)
    return out if summed is None else (out, summed)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up = [gate | up] along the last dimension."""
    library = _library()
    if library is None or gate_up.dim() != 2 or not _takes(gate_up):
        return None
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    kernel_call(library.silu_and_mul, KERNEL_DTYPES[gate_up.dtype], gate_up, gate_up.stride(0), out, width, rows,
                width)
    return out


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, head_size] rotated in place by cos / sin [T, head_size]
    (float32, or x's dtype: the model's buffers follow its dtype)."""
    library = _library()
    if library is None or x.dim() != 3 or x.shape[-1] % 2 or not _takes(x) or not _takes(cos, sin):
        return None
    if cos.dtype not in (torch.float32, x.dtype) or cos.stride(0) != sin.stride(0):
        return None
    tokens, heads, head_size = x.shape
    kernel_call(library.rotary_embedding, KERNEL_DTYPES[x.dtype], x, x.stride(0), x.stride(1), tokens, heads,
                head_size, KERNEL_DTYPES[cos.dtype], cos, sin, cos.stride(0))
    return x


# The layer ops these kernels implement (op names of model_registry/layers/ops.py).
KERNELS = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary_embedding": rotary_embedding}
IMPL_NAME = "cpu_fused"
PRIORITY = 10


def register_ops(register: Callable[..., None]) -> bool:
    """Offer the kernels to an op registry; False when they cannot be built."""
    if load() is None:
        return False
    for op, kernel in KERNELS.items():
        register(op, IMPL_NAME, lambda layer, kernel=kernel: kernel, priority=PRIORITY)
    return True
