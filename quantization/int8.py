"""int8: weight-only quantization, per output channel, at load.

Each row (output channel) of a float weight W is stored as int8 with one
scale, s = max|W_row| / 127, q = round(W_row / s) (symmetric, no zero
point): a quarter of float32's bytes, half of bfloat16's. The GEMM keeps
the activations in the compute dtype. In bfloat16 on a CPU with AMX,
batches of up to amx_linear.AMX_MAX_ROWS rows (decode) run on the
platform's AMX kernel (its own copy of q in tile layout: the float32 sum of
each column scaled and rounded once); otherwise batches of up to
grouped_linear.DECODE_MAX_ROWS rows run on the platform's grouped-weight
decode kernel (q as a W8 weight with one group per row,
platforms/cpu/grouped_linear.py: float32 sums, bias added before the one
rounding) where K is a multiple of 32 and the CPU has AVX-512;
``torch._weight_int8pack_mm`` (torch's int8 weight-packed matmul) for
other decode-sized batches on its grid, and the product with q cast to the
activations' dtype elsewhere. At decode sizes the grouped kernel took
0.6-0.9x the time of ``_weight_int8pack_mm`` (benchmarks/quant_gemm.py).

Mixture-of-experts layers (FusedMoE) are quantized the same way: each
expert's w13 [2I, H] and w2 [H, I] row by row (`w13_weight_scale` [E, 2I],
`w2_weight_scale` [E, H], in the compute dtype). Their "fused_moe" kernel
is the layer's reference routing (`FusedMoE.sum_over_experts`) with each
expert's two matmuls the int8 GEMM above, so it computes the reference over
the dequantized weights, to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu import amx_linear, grouped_linear
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.grouped_weight import GroupedWeight

if TYPE_CHECKING:
    from pagedllm.model_registry.layers.fused_moe import FusedMoE

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


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [E, N, K], scale float32 [E, N]): each expert's matrix per
    output channel (one expert at a time: the float32 copy stays one expert's)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):
        q[expert], scale[expert] = quantize_per_channel(weight[expert])
    return q, scale


def _int8_gemm(q: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    packed_mm = q.device.type == "cpu" and all(size % PACKED_MM_MULTIPLE == 0 for size in q.shape)
    # bfloat16 on an AMX CPU: decode batches on the platform's AMX kernel,
    # which streams the int8 tiles and widens them in cache.
    amx_packed = amx_linear.pack_int8(q) if scale.dtype == torch.bfloat16 else None
    scale_f32 = scale.float()  # the kernel's scales, converted once
    grouped = _grouped_kernel(q, scale_f32)

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if amx_packed is not None and rows.shape[0] <= amx_linear.AMX_MAX_ROWS \
                and not torch.compiler.is_compiling():
            amx_out = amx_linear.linear_int8(rows, amx_packed, scale_f32, bias)
            if amx_out is not None:
                return amx_out.reshape(*x.shape[:-1], q.shape[0])
        if grouped is not None and rows.shape[0] <= grouped_linear.DECODE_MAX_ROWS:
            return grouped(x, bias)
        if packed_mm and rows.shape[0] <= PACKED_MM_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows.contiguous(), q, scale)
        else:
            out = F.linear(rows, q.to(rows.dtype)) * scale
        out = out.reshape(*x.shape[:-1], q.shape[0])
        return out if bias is None else out + bias

    return apply_linear


def _grouped_kernel(q: torch.Tensor, scale_f32: torch.Tensor) -> grouped_linear.GroupedLinearKernel | None:
    """The platform's grouped-weight decode kernel over q (W8, one group per
    row), where it takes q: on the CPU, K on its grid, the kernel built."""
    weight = GroupedWeight(8, q.shape[1], q, scale_f32.reshape(-1, 1).contiguous(), None)
    if q.device.type != "cpu" or not grouped_linear.supports(weight):
        return None
    library = grouped_linear.load()
    return grouped_linear.GroupedLinearKernel(weight) if library is not None and library.decode_kernel else None


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

    def quantize_moe(self, layer: nn.Module, prefix: str) -> bool:
        if not isinstance(layer.w13_weight, torch.Tensor) or not layer.w13_weight.dtype.is_floating_point:
            return False  # stored some other way already
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            compute_dtype = weight.dtype
            q, scale = quantize_experts(weight)
            # NOTE: as for linear layers, the int8 tensor takes the float one's name.
            setattr(layer, name, nn.Parameter(q, requires_grad=False))
            layer.register_buffer(f"{name}_scale", scale.to(compute_dtype))
        return True

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        # Above any platform's kernels: a float GEMM cannot read int8 weights.
        register("linear", "int8", build_int8_gemm, priority=INT8_PRIORITY, supports=holds_int8_weight)
        register("fused_moe", "int8", build_int8_moe, priority=INT8_PRIORITY, supports=holds_int8_experts)


INT8_PRIORITY = 100


def holds_int8_weight(layer: nn.Module) -> bool:
    """Whether `layer` holds weights Int8WeightOnlyMethod converted."""
    weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.int8 and hasattr(layer, "weight_scale")


def build_int8_gemm(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    return _int8_gemm(layer.weight, layer.weight_scale)  # type: ignore[arg-type]


def holds_int8_experts(layer: nn.Module) -> bool:
    """Whether `layer` (a FusedMoE) holds experts Int8WeightOnlyMethod converted."""
    return all(
        isinstance(getattr(layer, name, None), torch.Tensor) and getattr(layer, name).dtype == torch.int8
        and hasattr(layer, f"{name}_scale")
        for name in ("w13_weight", "w2_weight")
    )


def build_int8_moe(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The "fused_moe" kernel of a converted FusedMoE: the layer's routing,
    each expert's matmuls the int8 GEMM of its own slice of the storage."""
    moe = cast("FusedMoE", layer)
    num_experts = moe.num_local_experts  # this rank's, under expert parallelism
    w13_scale, w2_scale = cast("torch.Tensor", moe.w13_weight_scale), cast("torch.Tensor", moe.w2_weight_scale)
    gate_up_gemms = [_int8_gemm(moe.w13_weight[e], w13_scale[e]) for e in range(num_experts)]
    down_gemms = [_int8_gemm(moe.w2_weight[e], w2_scale[e]) for e in range(num_experts)]
    w13_bias, w2_bias = moe.w13_bias, moe.w2_bias

    def gate_up(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return gate_up_gemms[expert](rows, None if w13_bias is None else w13_bias[expert])

    def down(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return down_gemms[expert](rows, None if w2_bias is None else w2_bias[expert])

    def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return moe.sum_over_experts(x, topk_weights, topk_ids, gate_up, down)

    return fused_moe


__all__ = [
    "Int8WeightOnlyMethod", "build_int8_gemm", "build_int8_moe", "holds_int8_experts", "holds_int8_weight",
    "quantize_experts", "quantize_per_channel",
]
