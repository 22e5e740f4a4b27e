"""The CPU's "linear" kernel for grouped 8-bit and 4-bit weights
(quantization/grouped_weight.py's layout: GPTQ, AWQ, GGUF, compressed-tensors
and the int8 method all convert into it).

Two paths, by the number of rows M of x:

- Decode sizes (M <= DECODE_MAX_ROWS, 8): a C kernel (csrc/grouped_linear.c)
  that streams each weight row once per 8 rows of x, dequantizes 16 codes
  at a time in registers (one FMA applies scale and offset) and sums in
  float32: the reference to float32 rounding, in x's dtype. AVX-512 only;
  elsewhere the reference runs.
- Larger batches (prefill): the weight dequantized to x's dtype into a
  scratch buffer by the same library (float32 sums, one rounding), then
  x's own GEMM (oneDNN through F.linear). In bfloat16 that rounds each
  weight to bfloat16, as a bfloat16 checkpoint is.

With `PAGEDLLM_CPU_GROUPED_INT8_ACTIVATIONS=1` (off by default) decode
batches quantize x to int8 first, in blocks of 32 as llama.cpp's Q8_0
activations, and take integer dot products (AVX512-VNNI), where g is 16, 32
or a multiple of 64 and K a multiple of 64 (else the exact kernel runs):
faster, and no longer the reference to float32 rounding
(`reference_int8_activations` is its reference).

Off the kernel's grid (K not a multiple of 32, g not a multiple of 16), on
another device, under torch.compile, without a compiler or with
`PAGEDLLM_CPU_GROUPED_LINEAR=0`: the layout's `reference_linear`.

Quantization methods offer it as their "linear" op with
`register_grouped_linear(register, name, weight_of, priority=...)`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu.graph import kernel_call
from pagedllm.platforms.cpu.kernel_build import load_library, prebuild_in_background

if TYPE_CHECKING:
    # NOTE: type-only: platforms/ may not import quantization/ at run time;
    # the weight is read by its attributes and methods.
    from pagedllm.quantization.grouped_weight import GroupedWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "grouped_linear.c"
# -ffp-contract=off: the dequantization (code * scale + offset) rounds as
# the reference's two torch ops; the decode kernel's FMAs are explicit.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp",
          "-ffp-contract=off", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_GROUPED_LINEAR"
INT8_ACTIVATIONS_SWITCH = "PAGEDLLM_CPU_GROUPED_INT8_ACTIVATIONS"
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Batches of at most this many rows run on the decode kernel. Its float32
# FMAs do 16 multiply-adds an instruction where a bfloat16 GEMM's
# AVX512-BF16 dot products do 32, so once the rows make the GEMM compute-
# bound the batched path wins: the two crossed at about 8-12 rows on the
# ~100M model's shapes (2 threads, bfloat16; benchmarks/quant_gemm.py).
DECODE_MAX_ROWS = 8
K_MULTIPLE, GROUP_MULTIPLE = 32, 16  # the decode kernel's grid (csrc/grouped_linear.c)

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class Library(NamedTuple):
    cdll: ctypes.CDLL
    decode_kernel: bool  # grouped_linear runs here (AVX-512); grouped_dequantize always does
    int8_kernel: bool  # grouped_linear_q8a runs here (AVX-512 and AVX512-VNNI)


@functools.cache
def load() -> Library | None:
    """The kernel library, built if needed; None when it cannot be (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU grouped-weight linear kernel")
    if library is None:
        return None
    library.grouped_linear_available.restype, library.grouped_linear_available.argtypes = _INT, []
    library.grouped_linear.restype = _INT
    library.grouped_linear.argtypes = [_INT, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _INT, _PTR]
    library.grouped_linear_q8a_available.restype, library.grouped_linear_q8a_available.argtypes = _INT, []
    library.grouped_linear_q8a.restype = _INT
    library.grouped_linear_q8a.argtypes = library.grouped_linear.argtypes
    library.grouped_dequantize.restype = None
    library.grouped_dequantize.argtypes = [_INT, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _PTR]
    decode_kernel = bool(library.grouped_linear_available())
    if not decode_kernel:
        logger.info("CPU grouped-weight decode kernel needs AVX-512: decode batches run the torch reference")
    return Library(library, decode_kernel, bool(library.grouped_linear_q8a_available()))


class PackedGroupedWeight(NamedTuple):
    """A GroupedWeight and the decode kernel's copy of its codes (W4 in the
    kernel's nibble order; W8 the codes themselves), made once at load."""

    weight: GroupedWeight
    kernel_codes: torch.Tensor | None  # None: off the kernel's grid


def on_kernel_grid(weight: GroupedWeight) -> bool:
    return (weight.codes.is_cpu and weight.in_features % K_MULTIPLE == 0
            and weight.group_size % GROUP_MULTIPLE == 0 and (weight.bits == 8 or weight.offsets is not None))


def w4_kernel_order(weight: GroupedWeight) -> torch.Tensor:
    """W4 codes [N, K // 2] in the kernel's order: per block of 32 inputs,
    byte j = input j (low nibble) | input 16 + j (high nibble)."""
    unpacked = weight.unpacked_codes()
    num_out, num_in = unpacked.shape
    blocks = unpacked.view(num_out, num_in // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(num_out, num_in // 2).contiguous()


def prepack(weight: GroupedWeight) -> PackedGroupedWeight:
    """`weight` with the decode kernel's copy of its codes (once, at load)."""
    weight = weight.validate()
    # The C code reads every tensor as one contiguous run (a no-op for the usual ones).
    weight = weight._replace(codes=weight.codes.contiguous(), scales=weight.scales.contiguous(),
                             offsets=None if weight.offsets is None else weight.offsets.contiguous())
    if not on_kernel_grid(weight):
        return PackedGroupedWeight(weight, None)
    kernel_codes = w4_kernel_order(weight) if weight.bits == 4 else weight.codes
    return PackedGroupedWeight(weight, kernel_codes)


class GroupedLinearKernel:
    """(x [..., K], bias [N] or None) -> x @ W.T + bias, in x's dtype."""

    def __init__(self, weight: GroupedWeight | PackedGroupedWeight) -> None:
        self.packed = weight if isinstance(weight, PackedGroupedWeight) else prepack(weight)
        self.weight = self.packed.weight
        self.num_out, self.num_in = self.weight.out_features, self.weight.in_features
        self._bias_key: torch.Tensor | None = None  # the last bias seen, and its float32 copy
        self._bias_f32: torch.Tensor | None = None
        self.int8_activations = int8_activations_enabled()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        library = None if torch.compiler.is_compiling() else load()
        if (library is None or self.packed.kernel_codes is None or x.dtype not in KERNEL_DTYPES or not x.is_cpu
                or x.shape[-1] != self.num_in):
            return self.weight.linear(x, bias)
        rows = x.reshape(-1, self.num_in)
        out = None
        if rows.shape[0] <= DECODE_MAX_ROWS and library.decode_kernel:
            out = self.decode(library, rows, bias)
        if out is None:
            out = self.batched(library, rows, bias)
        return out.view(*x.shape[:-1], self.num_out)

    def float32_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """bias as contiguous float32, converted once per bias tensor (a layer passes the same one)."""
        if bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()):
            return bias
        if bias is not self._bias_key:
            self._bias_key, self._bias_f32 = bias, bias.detach().float().contiguous()
        return self._bias_f32

    def decode(self, library: Library, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        weight = self.weight
        x_f32 = rows.float().contiguous()
        out = torch.empty(rows.shape[0], self.num_out, dtype=rows.dtype)
        status = 1
        if self.int8_activations and library.int8_kernel:
            status = kernel_call(library.cdll.grouped_linear_q8a, weight.bits, x_f32, rows.shape[0], self.num_in,
                                 self.packed.kernel_codes, weight.scales, weight.offsets, weight.group_size,
                                 self.float32_bias(bias), self.num_out, KERNEL_DTYPES[rows.dtype], out)
        if status == 0:
            return out
        status = kernel_call(library.cdll.grouped_linear, weight.bits, x_f32, rows.shape[0], self.num_in,
                             self.packed.kernel_codes, weight.scales, weight.offsets, weight.group_size,
                             self.float32_bias(bias), self.num_out, KERNEL_DTYPES[rows.dtype], out)
        return out if status == 0 else None

    def batched(self, library: Library, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The weight dequantized to x's dtype, then x's own GEMM."""
        weight = self.weight
        dense = torch.empty(self.num_out, self.num_in, dtype=rows.dtype)
        kernel_call(library.cdll.grouped_dequantize, weight.bits, weight.codes, weight.scales, weight.offsets,
                    weight.group_size, self.num_in, 0, self.num_out, KERNEL_DTYPES[rows.dtype], dense)
        return F.linear(rows, dense, None if bias is None else bias.to(rows.dtype))


def int8_activations_enabled() -> bool:
    """Whether decode batches quantize x to int8 (read when a kernel is made)."""
    return os.environ.get(INT8_ACTIVATIONS_SWITCH, "0") == "1"


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K] int8 values as float32, scales [M, K // block]):
    scale = max|x| / 127 per block, q = round-half-even(x / scale), 0 where scale is 0."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    q = torch.where(scales.unsqueeze(-1) > 0, torch.round(blocks / safe), torch.zeros_like(blocks))
    return q.reshape(x.shape), scales


def reference_int8_activations(weight: GroupedWeight, x: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-activation path's math in plain torch (float64 sums), in x's dtype."""
    rows = x.reshape(-1, weight.in_features)
    q, scales = quantize_activations(rows)
    dequantized = (q.reshape(rows.shape[0], -1, 32) * scales.unsqueeze(-1)).reshape(rows.shape).double()
    out = dequantized @ weight.dequantize(torch.float64).T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def supports(weight: GroupedWeight) -> bool:
    """Whether the C paths take `weight` (else the kernel computes the reference)."""
    return on_kernel_grid(weight) and load() is not None


def register_grouped_linear(register: Callable[..., None], name: str,
                            weight_of: Callable[[nn.Module], GroupedWeight | None], *, priority: int) -> None:
    """Offer GroupedLinearKernel as the "linear" op (model_registry/layers/ops.py)
    of the layers for which `weight_of(layer)` returns their GroupedWeight
    (None: a layer the method did not convert)."""

    def holds_grouped_weight(layer: nn.Module) -> bool:
        return weight_of(layer) is not None

    def build(layer: nn.Module) -> Any:
        prebuild_in_background(load)  # the compile overlaps the rest of the model's preparation
        weight = weight_of(layer)
        assert weight is not None  # supports() said so
        return GroupedLinearKernel(weight)

    register("linear", name, build, priority=priority, supports=holds_grouped_weight)


__all__ = ["DECODE_MAX_ROWS", "GroupedLinearKernel", "PackedGroupedWeight", "prepack", "register_grouped_linear",
           "supports"]
