"""The GEMMs of W8A8 schemes (vLLM's semantics) and of FP8 weight-only.

W8A8-INT8: the activations are quantized to int8, per token (dynamic:
each row x_t gets s_t = max|x_t| / 127, q_t = round(x_t / s_t) clamped to
[-128, 127]) or per tensor (static: the checkpoint's input_scale); the
product q_x @ q_w.T is summed exactly in int32 (``torch._int_mm``) and
scaled by s_x (per row) and s_w (per output channel) in float32.

FP8 W8A8: the same with float8_e4m3fn (s_t = max|x_t| / 448, q_t =
(x_t / s_t) clamped to +-448 and rounded to fp8); the product of the fp8
codes in float32 (``torch._scaled_mm`` where the CPU has it; else the codes
dequantized and multiplied in float32), times s_x and s_w.

FP8 weight-only: x @ float(q_w).T in float32, times s_w.

The bias is added in float32; the result is cast to x's dtype. `reference`
functions are the same arithmetic in plain float32 torch, for the tests.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

INT8_MIN, INT8_MAX = -128, 127
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = torch.finfo(torch.float32).tiny


class ScaledWeight(NamedTuple):
    """A W8A8 / FP8 layer's storage after loading."""

    codes: torch.Tensor  # int8 or float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [N], per output channel
    input_scale: torch.Tensor | None  # float32 [] (static activations) or None (dynamic per token)
    quantize_input: bool  # False: weight-only (FP8-W8A16)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, input_scale: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(codes [M, K] in `dtype`, scales float32 [M, 1]) of x [M, K]: per row
    (input_scale None) or with the one static scale."""
    x = x.float()
    limit = INT8_MAX if dtype == torch.int8 else FP8_MAX
    if input_scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=TINY) / limit
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    scaled = x / scale
    if dtype == torch.int8:
        return torch.round(scaled).clamp(INT8_MIN, INT8_MAX).to(torch.int8), scale
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _fp8_table() -> torch.Tensor:
    """Every float8_e4m3fn byte's value in float32 (torch converts fp8 on the
    CPU one element at a time; indexing the table is the same values)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()


def fp8_to_float(codes: torch.Tensor) -> torch.Tensor:
    if not codes.is_cpu:
        return codes.float()
    return _fp8_table().index_select(0, codes.view(torch.uint8).reshape(-1).long()).view(codes.shape)


def _code_product(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """x_codes @ w_codes.T in float32: int32 sums for int8, float32 for fp8."""
    if w_codes.dtype == torch.int8:
        if x_codes.is_cpu or x_codes.shape[0] > 16:  # CUDA's _int_mm wants M > 16
            return torch._int_mm(x_codes, w_codes.t()).float()
        return (x_codes.int() @ w_codes.int().t()).float()
    one = torch.ones((), dtype=torch.float32, device=x_codes.device)
    try:
        return torch._scaled_mm(x_codes, w_codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):  # a device or shape _scaled_mm does not take
        return fp8_to_float(x_codes) @ fp8_to_float(w_codes).t()


def scaled_linear(x: torch.Tensor, weight: ScaledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype (module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    if weight.quantize_input:
        x_codes, x_scale = quantize_rows(rows, weight.codes.dtype, weight.input_scale)
        out = _code_product(x_codes.contiguous(), weight.codes) * x_scale
    else:
        out = F.linear(rows.float(), fp8_to_float(weight.codes))
    out = out * weight.scales
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.codes.shape[0])


def reference_scaled_linear(x: torch.Tensor, weight: ScaledWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The same in plain float32 torch: codes dequantized, one matmul."""
    w = weight.codes.float() * weight.scales[:, None]
    rows = x.reshape(-1, x.shape[-1]).float()
    if weight.quantize_input:
        x_codes, x_scale = quantize_rows(rows, weight.codes.dtype, weight.input_scale)
        rows = x_codes.float() * x_scale
    out = rows @ w.t() + (0 if bias is None else bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], weight.codes.shape[0])


__all__ = ["ScaledWeight", "fp8_to_float", "quantize_rows", "reference_scaled_linear", "scaled_linear"]
