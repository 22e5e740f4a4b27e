"""bfloat16 linear layers on AMX tiles for decode-sized batches (csrc/amx_linear.c).

A decode step multiplies a few rows by every weight of the model, so its
GEMMs are bound by how fast the weights stream from memory. The kernel packs
each weight once into AMX's tile layout and streams it in one contiguous run
per 32 output columns; at decode sizes that beats oneDNN's prepacked GEMM
(`benchmarks/amx_linear.py`; the numbers: docs/performance.md). From about
100 rows on, oneDNN's blocking wins, so larger batches keep it
(`AMX_MAX_ROWS`).

Sums are float32 (AMX multiplies bf16 pairs exactly), rounded once to
bfloat16: the result is F.linear's to within its summation order.

Built and loaded like the other CPU kernels (plain C, ctypes, the system C
compiler; kernel_build.py). Without AMX, without a compiler, for K not a
multiple of 32 or with `PAGEDLLM_CPU_AMX_LINEAR=0`, `pack` returns None and
the layer keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pagedllm.platforms.cpu.graph import kernel_call
from pagedllm.platforms.cpu.host_memory import anonymous_zeros
from pagedllm.platforms.cpu.kernel_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "amx_linear.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_AMX_LINEAR"
# Batches of at most this many rows run on the kernel.
AMX_MAX_ROWS = 64
K_MULTIPLE = 32
RUN = 32  # output columns per packed run (csrc/amx_linear.c): N is padded to a multiple

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be built or
    the CPU (or the kernel's compiler target) has no AMX."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU AMX linear kernel")
    if library is None or not library.amx_linear_available():
        return None
    library.amx_linear_packed_elements.restype, library.amx_linear_packed_elements.argtypes = _I64, [_I64, _I64]
    for name in ("amx_linear_pack", "amx_linear_pack_int8"):
        getattr(library, name).restype, getattr(library, name).argtypes = None, [_PTR, _I64, _I64, _I64, _PTR]
    library.amx_linear.restype = library.amx_linear_int8.restype = ctypes.c_int
    library.amx_linear.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    library.amx_linear_int8.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    return library


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in the kernel's tile layout, or None where the kernel
    cannot take it (not bfloat16 on the CPU, K not a multiple of 32, no AMX)."""
    return _pack(weight, torch.bfloat16, "amx_linear_pack")


def pack_int8(q: torch.Tensor) -> torch.Tensor | None:
    """int8 weights q [N, K] (of W = q * scale[n]) in the kernel's tile
    layout, one byte an element (`linear_int8`); None as for `pack`."""
    return _pack(q, torch.int8, "amx_linear_pack_int8")


def _pack(weight: torch.Tensor, dtype: torch.dtype, packer: str) -> torch.Tensor | None:
    if weight.dtype != dtype or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    num_out, num_in = weight.shape
    if num_in % K_MULTIPLE or num_in == 0 or num_out == 0:
        return None
    library = load()
    if library is None:
        return None
    weight = weight.detach()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    # Huge pages: a decode step streams every packed weight (host_memory.py).
    packed = anonymous_zeros(library.amx_linear_packed_elements(num_out, num_in), dtype, huge_pages=True)
    getattr(library, packer)(weight.data_ptr(), weight.stride(0), num_out, num_in, packed.data_ptr())
    return packed


def _takes_rows(x: torch.Tensor, packed: torch.Tensor, num_out: int) -> bool:
    """Whether the kernel takes x; a packed weight of another shape than
    [num_out, x's K] is a caller's error (the kernel would read past it)."""
    if x.dim() == 2 and packed.numel() != -(-num_out // RUN) * RUN * x.shape[1]:
        raise ValueError(f"packed weight of {packed.numel()} elements is not [{num_out}, {x.shape[1]}]")
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.device.type == "cpu"


def _float32(t: torch.Tensor) -> torch.Tensor:
    """t as the kernel's contiguous float32 (t itself when it is one already)."""
    return t.detach().float().contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, num_out: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] (bfloat16, rows with contiguous elements) times the packed
    weight, plus bias; None when x is of another kind (the caller's GEMM runs)."""
    library = load()
    if library is None or not _takes_rows(x, packed, num_out):
        return None
    num_rows, num_in = x.shape
    out = torch.empty(num_rows, num_out, dtype=torch.bfloat16)
    bias_f32 = None if bias is None else _float32(bias)
    status = kernel_call(library.amx_linear, x, x.stride(0), packed, bias_f32, out, num_out, num_rows, num_out, num_in)
    return out if status == 0 else None


def linear_int8(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x [M, K] (bfloat16) times W = q * scale[n] with q packed by
    `pack_int8`: (x . q^T) * scale + bias, the float32 sums scaled and
    rounded to bfloat16 once; None when x is of another kind. A float32
    `scale` is used as it is (a caller converts it once, not every call)."""
    num_out = scale.shape[0]
    library = load()
    if library is None or not _takes_rows(x, packed, num_out):
        return None
    num_rows, num_in = x.shape
    out = torch.empty(num_rows, num_out, dtype=torch.bfloat16)
    scale_f32, bias_f32 = _float32(scale), None if bias is None else _float32(bias)
    status = kernel_call(library.amx_linear_int8, x, x.stride(0), packed, scale_f32, bias_f32, out, num_out, num_rows,
                         num_out, num_in)
    return out if status == 0 else None
