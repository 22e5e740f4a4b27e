"""int8: weight-only quantization, per output channel, at load.

Each row (output channel) of a float weight W is stored as int8 with one
scale, s = max|W_row| / 127, q = round(W_row / s) (symmetric, no zero
point): a quarter of float32's bytes, half of bfloat16's. The GEMM keeps
the activations in the compute dtype. In bfloat16 on a CPU with AMX,
batches of up to amx_linear.AMX_MAX_ROWS rows (decode) run on the
platform's AMX kernel (its own copy of q in tile layout: the float32 sum of
each column scaled and rounded once); otherwise ``torch._weight_int8pack_mm``
(torch's int8 weight-packed matmul: x @ q^T, each output column times its
scale) on the CPU for shapes on its grid and decode-sized batches, the same
product with q cast to the activations' dtype elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu import amx_linear
from pagedllm.quantization.base import QuantizationMethod

INT8_MAX = 127
# NOTE: torch's CPU kernel (AVX-512 / AMX for bfloat16) crashed on shapes off
# this grid (K = 20 or 24, N = 17 in bfloat16): it runs only on multiples of it.
PACKED_MM_MULTIPLE = 16
# That kernel is a matrix-vector product per row: ~3x faster than a bfloat16
# GEMM for one row (it reads a quarter of the bytes), but its time grows with
# the rows, past the dequantized GEMM's from about 8 rows (K=768, N=4096, 2
# cores). Larger batches cast the weight and use the dtype's own GEMM.
PACKED_MM_MAX_ROWS = 8


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale float32 [N]) with weight ~= q * scale[:, None]."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _int8_gemm(q: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    packed_mm = q.device.type == "cpu" and all(size % PACKED_MM_MULTIPLE == 0 for size in q.shape)
    # bfloat16 on an AMX CPU: decode batches on the platform's AMX kernel,
    # which streams the int8 tiles and widens them in cache.
    amx_packed = amx_linear.pack_int8(q) if scale.dtype == torch.bfloat16 else None
    scale_f32 = scale.float()  # the kernel's scales, converted once

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if amx_packed is not None and rows.shape[0] <= amx_linear.AMX_MAX_ROWS \
                and not torch.compiler.is_compiling():
            amx_out = amx_linear.linear_int8(rows, amx_packed, scale_f32, bias)
            if amx_out is not None:
                return amx_out.reshape(*x.shape[:-1], q.shape[0])
        if packed_mm and rows.shape[0] <= PACKED_MM_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows.contiguous(), q, scale)
        else:
            out = F.linear(rows, q.to(rows.dtype)) * scale
        out = out.reshape(*x.shape[:-1], q.shape[0])
        return out if bias is None else out + bias

    return apply_linear


class Int8WeightOnlyMethod(QuantizationMethod):
    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        compute_dtype = layer.weight.dtype
        q, scale = quantize_per_channel(layer.weight)
        # NOTE: the float weight is dropped (the memory is the point); the
        # int8 one takes its name, so the layer's parameter list stays the same.
        layer.weight = nn.Parameter(q, requires_grad=False)
        weight_scale = scale.to(compute_dtype)
        layer.register_buffer("weight_scale", weight_scale)
        return True

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        # Above any platform's GEMM: a float GEMM cannot read int8 weights.
        register("linear", "int8", build_int8_gemm, priority=INT8_PRIORITY, supports=holds_int8_weight)


INT8_PRIORITY = 100


def holds_int8_weight(layer: nn.Module) -> bool:
    """Whether `layer` holds weights Int8WeightOnlyMethod converted."""
    weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.int8 and hasattr(layer, "weight_scale")


def build_int8_gemm(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    return _int8_gemm(layer.weight, layer.weight_scale)  # type: ignore[arg-type]


__all__ = ["Int8WeightOnlyMethod", "build_int8_gemm", "holds_int8_weight", "quantize_per_channel"]
