"""The CUDA platform's "fused_moe" kernel in Triton (vLLM's fused-MoE design).

A step's token-expert pairs (T tokens x top-k; pair p = token * k + j) are
first sorted by expert into blocks of BLOCK_M rows (`moe_align_block_size`):
each expert's pairs are one segment padded to a multiple of BLOCK_M with a
sentinel id (T * k), an expert with no pairs gets no block, and each block
records its expert. Then two grouped GEMMs run one program per (block,
column tile), every block multiplying its rows by its one expert's weights:

1. h[p] = act(x[p // k] @ W13[e]^T + b13[e]): the gate and up tiles of the
   same columns are computed by one program, so the activation (SiLU * up,
   or GPT-OSS's clamped swigluoai) is applied in registers and only [T * k, I]
   is written;
2. y[p] = (h[p] @ W2[e]^T + b2[e]) * topk_weights[p], stored in float32.

The output is y summed over each token's k rows in float32, then cast to x's
dtype (what `FusedMoE.forward_reference` computes, to rounding).

NOTE: nothing here reads a device value on the host (the align step is torch
ops whose sizes come from shapes alone, and the kernels skip the blocks past
the padded total they read on the device), so a step that runs it may be
captured as a CUDA graph. Importing this module imports triton: the platform
imports it only when a layer is bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch
import triton
import triton.language as tl

# Activation codes of the first GEMM (constexpr: one compiled kernel each).
NO_ACTIVATION, SILU, SWIGLUOAI = 0, 1, 2
ACTIVATION_CODES = {"silu": SILU, "swigluoai": SWIGLUOAI}
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class AlignedPairs(NamedTuple):
    """The token-expert pairs sorted by expert into blocks of `block_m` rows."""

    sorted_token_ids: torch.Tensor  # int32 [max_padded]: pair ids; T * k pads a segment
    expert_ids: torch.Tensor  # int32 [max_padded / block_m]: each block's expert; -1 past the total
    num_tokens_post_padded: torch.Tensor  # int32 [1]: the padded total, on the device


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded total known from shapes alone: at most
    min(E, pairs) experts are non-empty, each padded by < block_m rows;
    rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> AlignedPairs:
    """vLLM's `moe_align_block_size` in torch ops that do not sync with the
    host: pairs grouped by expert (stable: ascending pair id within an
    expert), each expert's segment padded to a multiple of `block_m`, empty
    experts skipped."""
    flat_ids = topk_ids.flatten()
    num_pairs, device = flat_ids.numel(), flat_ids.device
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    # scatter_add_, not bincount: bincount reads the largest id on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts
    starts = counts.cumsum(0) - counts
    order = flat_ids.argsort(stable=True)  # pair ids, by expert
    sorted_experts = flat_ids[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    destination = padded_starts[sorted_experts] + rank_in_expert
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, destination, order.to(torch.int32))
    # Block b belongs to the first expert whose padded segment ends past b's
    # first row: an empty expert's segment ends where it starts and is passed over.
    total = padded_ends[-1:]
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < total, block_experts, -1).to(torch.int32)
    return AlignedPairs(sorted_token_ids, expert_ids, total.to(torch.int32))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]; row of pair p: p // A_ROW_DIV
    b_ptr,  # [E, N or 2N, K]: nn.Linear's layout per expert
    bias_ptr,  # [E, N or 2N] (unused without HAS_BIAS)
    c_ptr,  # [T * k, N], indexed by pair
    topk_weights_ptr,  # float32 [T * k]
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,  # output columns (I for the gated first GEMM: W13 holds 2I rows)
    K,
    num_valid_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bias_e,
    stride_cm,
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row blocks sweep the columns together, so
    # an expert's weight tiles are reused from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # past the padded total: a block no expert has
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair_ids < num_valid_pairs  # a padding row holds the sentinel
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + (pair_ids // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ACTIVATION != 0:  # the up rows follow the gate rows, N further down
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE_DOT:  # noqa: SIM108 - a constexpr branch: each compiled kernel keeps one dot
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if ACTIVATION != 0:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE_DOT:  # noqa: SIM108 - a constexpr branch
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert * stride_bias_e + offs_n
        acc += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != 0:
            acc_up += tl.load(bias_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # SiLU(gate) * up
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACTIVATION == 2:  # GPT-OSS: (clamp(up) + 1) * gate * sigmoid(alpha * gate), gate clamped above
        gate = tl.minimum(acc, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        acc = (up + 1.0) * gate * tl.sigmoid(gate * swiglu_alpha)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair_ids, mask=row_ok, other=0.0)[:, None]
    tl.store(
        c_ptr + pair_ids[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


class MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """vLLM's default shape rule: small blocks of rows when each expert gets
    few pairs (decode), wider ones when a prefill fills them."""
    pairs_per_expert = num_pairs / num_experts
    if pairs_per_expert <= 16:
        return MoeConfig(16, 64, 64, 1, 4, 3)
    if pairs_per_expert <= 64:
        return MoeConfig(32, 64, 64, 8, 4, 3)
    return MoeConfig(64, 128, 64, 8, 8, 3)


def _launch(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    topk_weights: torch.Tensor, aligned: AlignedPairs, *, a_row_div: int, activation: int,
    mul_routed_weight: bool, alpha: float, limit: float, config: MoeConfig,
) -> None:
    num_cols = out.shape[1]
    num_row_blocks = aligned.expert_ids.numel()
    grid = (num_row_blocks * triton.cdiv(num_cols, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, weight, bias if bias is not None else weight, out, topk_weights,
        aligned.sorted_token_ids, aligned.expert_ids, aligned.num_tokens_post_padded,
        num_cols, a.shape[1], out.shape[0],
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        alpha, limit,
        A_ROW_DIV=a_row_div,
        ACTIVATION=activation,
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        # float32 stays float32 (a TF32 dot would round inputs to 10 bits).
        IEEE_DOT=a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13_weight: torch.Tensor,  # [E, 2I, H]
    w2_weight: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float32 [T, k]
    topk_ids: torch.Tensor,  # int64 [T, k]
    *,
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = float("inf"),
    config: MoeConfig | None = None,
) -> torch.Tensor:  # [T, H] in x's dtype
    """Each token's sum over its k experts of weight * expert MLP."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13_weight.shape[0], w2_weight.shape[2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, w2_weight.shape[1])
    config = config or default_config(num_pairs, num_experts)
    x = x.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    aligned = moe_align_block_size(topk_ids, config.block_m, num_experts)
    hidden = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    _launch(x, w13_weight, w13_bias, hidden, topk_weights, aligned, a_row_div=top_k,
            activation=ACTIVATION_CODES[activation], mul_routed_weight=False, alpha=swiglu_alpha,
            limit=swiglu_limit, config=config)
    weighted = torch.empty(num_pairs, w2_weight.shape[1], dtype=torch.float32, device=x.device)  # [T * k, H]
    _launch(hidden, w2_weight, w2_bias, weighted, topk_weights, aligned, a_row_div=1,
            activation=NO_ACTIVATION, mul_routed_weight=True, alpha=0.0, limit=0.0, config=config)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class MoeLayer(Protocol):
    """What the kernel reads of a FusedMoE layer (model_registry/layers/fused_moe.py)."""

    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    activation: str
    swiglu_alpha: float
    swiglu_limit: float


def build(module: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The kernel a FusedMoE layer calls (its "fused_moe" op). The weights
    are read at each call, so a layer whose parameters are replaced later
    computes with the new ones."""
    layer = cast("MoeLayer", module)

    def kernel(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, activation=layer.activation,
            swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit,
        )

    return kernel
