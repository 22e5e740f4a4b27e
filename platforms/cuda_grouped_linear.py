"""The CUDA platform's GEMM over grouped 4-bit weights in Triton
(quantization/grouped_weight.py's W4 layout: GPTQ and AWQ checkpoints).

One program per (BLOCK_M rows of x, BLOCK_N output channels); along K it
loads x's tile and the codes' bytes [BLOCK_K, BLOCK_N] (input k in byte
k // 2, the low nibble for k even), dequantizes them in registers with each
input's group scale and offset (w = code * scale + offset, in float32),
casts the tile to x's dtype and accumulates the dot in float32. float32
stays float32 (an IEEE dot, not TF32). The output is cast to x's dtype once.

Importing this module imports triton: quantization methods import it only
when a layer on a CUDA device takes the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    # NOTE: type-only: platforms/ may not import quantization/ at run time;
    # the weight is read by its attributes and methods.
    from pagedllm.quantization.grouped_weight import GroupedWeight

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _w4_grouped_gemm_kernel(
    x_ptr,  # [M, K], rows stride_xm apart, inputs contiguous
    codes_ptr,  # uint8 [N, K // 2]
    scales_ptr,  # float32 [N, K // group_size]
    offsets_ptr,  # float32 [N, K // group_size]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [M, N], rows stride_om apart
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    col_ok = offs_n < N
    num_groups = K // group_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        packed = tl.load(codes_ptr + offs_n[None, :] * (K // 2) + (offs_k // 2)[:, None], mask=w_mask, other=0)
        codes = (packed.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        group_offs = offs_n[None, :] * num_groups + (offs_k // group_size)[:, None]
        scales = tl.load(scales_ptr + group_offs, mask=w_mask, other=0.0)
        offsets = tl.load(offsets_ptr + group_offs, mask=w_mask, other=0.0)
        w = (codes.to(tl.float32) * scales + offsets).to(a.dtype)
        if IEEE_DOT:  # noqa: SIM108 - a constexpr branch: each compiled kernel keeps one dot
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(num_rows: int) -> GemmConfig:
    """Decode batches: a thin row tile and wide column tiles; larger ones square tiles."""
    if num_rows <= 16:
        return GemmConfig(16, 64, 64, 4, 3)
    if num_rows <= 64:
        return GemmConfig(32, 64, 64, 4, 3)
    return GemmConfig(64, 128, 64, 8, 3)


def w4_grouped_linear(x: torch.Tensor, weight: GroupedWeight, bias: torch.Tensor | None = None,
                      config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for a W4 GroupedWeight, in x's dtype."""
    num_out, num_in = weight.out_features, weight.in_features
    rows = x.reshape(-1, num_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], num_out, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], num_out)
    config = config or default_config(rows.shape[0])
    grid = (triton.cdiv(rows.shape[0], config.block_m), triton.cdiv(num_out, config.block_n))
    assert weight.offsets is not None  # the W4 layout has them (GroupedWeight.validate)
    _w4_grouped_gemm_kernel[grid](
        rows, weight.codes, weight.scales, weight.offsets, bias if bias is not None else weight.scales, out,
        rows.shape[0], num_out, num_in, weight.group_size, rows.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.view(*x.shape[:-1], num_out)


def build(weight: GroupedWeight) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The "linear" kernel of a layer holding `weight` (W4, on the CUDA device)."""
    weight = weight._replace(codes=weight.codes.contiguous(), scales=weight.scales.contiguous(),
                             offsets=None if weight.offsets is None else weight.offsets.contiguous())

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return weight.linear(x, bias)
        return w4_grouped_linear(x, weight, bias)

    return apply_linear


__all__ = ["GemmConfig", "build", "default_config", "w4_grouped_linear"]
