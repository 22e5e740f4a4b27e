"""The CUDA platform's kernels for the "lora" op (a LoRASlots layer's
shrink/expand, model_registry/layers/lora.py) in Triton, punica's BGMV
form (Chen et al., 2023; vLLM's punica kernels): each row gathers its own
adapter by its slot, so one launch serves any mix of adapters and rows
without one.

- shrink: one program per (row, BLOCK_R rank rows): h[t] = x[t] @ A[s].T
  over K in BLOCK_K tiles, float32 sums into a float32 scratch [T, R];
- expand: one program per (row, BLOCK_N output rows): y[t] += h[t] @ B[s].T
  (only the rank block of each stacked sub-matrix is read: B is zero
  elsewhere), the sum added to y in float32 and rounded once.

A row whose slot is 0 returns at once. The slots are read on the device,
and the launch shapes depend only on T, so the kernels are CUDA-graph safe:
a replay follows whatever slots the runner wrote into its buffer. No
segment (SGMV) form: per-row gathers re-read an adapter's weights per row,
from L2 at decode sizes; a prefill of one adapter pays that on long chunks.
No `tl.dot` (GEMV-shaped work), so float16 and bfloat16 also run in the
Triton interpreter.

Importing this module imports triton: the platform imports it only when a
layer on a CUDA device takes the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_R, BLOCK_K, BLOCK_N = 16, 64, 64


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K], rows stride_xm apart
    slots_ptr,  # int32 [T]
    a_ptr,  # [S + 1, R, K] contiguous
    h_ptr,  # float32 [T, R] contiguous
    K,
    R,
    stride_xm,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != 0:
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_slot = a_ptr + slot * R * K
        for k_start in range(0, K, BLOCK_K):
            offs_k = k_start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xk = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_slot + offs_r[:, None] * K + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(h_ptr + row * R + offs_r, acc, mask=r_ok)


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # float32 [T, R]
    slots_ptr,  # int32 [T]
    b_ptr,  # [S + 1, N, R] contiguous
    sub_ptr,  # int32 [N]: each output row's sub-matrix
    y_ptr,  # [T, N], rows stride_ym apart
    N,
    R,
    MAX_RANK,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        # each output row reads its own sub-matrix's rank block of B and h
        cols = tl.load(sub_ptr + offs_n, mask=n_ok, other=0)[:, None] * MAX_RANK + tl.arange(0, BLOCK_RANK)[None, :]
        mask = n_ok[:, None] & (tl.arange(0, BLOCK_RANK) < MAX_RANK)[None, :]
        b = tl.load(b_ptr + slot * N * R + offs_n[:, None] * R + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + row * R + cols, mask=mask, other=0.0)
        delta = tl.sum(b * h, axis=1)
        y_rows = y_ptr + row * stride_ym + offs_n
        y = tl.load(y_rows, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_rows, (y + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


def sub_matrix_of_rows(output_sizes: list[int], device: torch.device) -> torch.Tensor:
    """int32 [N]: the stacked sub-matrix each output row belongs to."""
    sizes = torch.tensor(output_sizes, dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(output_sizes), dtype=torch.int32), sizes).to(device)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, sub_of_row: torch.Tensor, max_rank: int) -> None:
    """y [T, N] += each row's (x[t] @ lora_a[s].T) @ lora_b[s].T, s = token_slots[t] != 0."""
    num_rows, num_in = x.shape
    rank_total, num_out = lora_a.shape[1], lora_b.shape[1]
    if token_slots.shape != (num_rows,) or y.shape != (num_rows, num_out):  # the kernels read T slots and rows
        raise ValueError(f"LoRA rows: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(token_slots.shape)}")
    if num_rows == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert y.stride(-1) == 1 and lora_a.is_contiguous() and lora_b.is_contiguous()
    slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
    shrunk = torch.empty(num_rows, rank_total, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(num_rows, triton.cdiv(rank_total, BLOCK_R))](
        x, slots, lora_a, shrunk, num_in, rank_total, x.stride(0), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    _lora_expand_kernel[(num_rows, triton.cdiv(num_out, BLOCK_N))](
        shrunk, slots, lora_b, sub_of_row, y, num_out, rank_total, max_rank, y.stride(0), BLOCK_N=BLOCK_N,
        BLOCK_RANK=triton.next_power_of_2(max_rank),
    )


def build(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The "lora" kernel of a LoRASlots layer on the CUDA device."""
    sub_of_row = sub_matrix_of_rows(list(layer.output_sizes), layer.lora_b.device)  # type: ignore[arg-type]
    max_rank = int(layer.max_rank)  # type: ignore[arg-type]

    def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        lora_shrink_expand(y, x, token_slots, layer.lora_a, layer.lora_b, sub_of_row, max_rank)  # type: ignore[arg-type]

    return add_lora


__all__ = ["build", "lora_shrink_expand", "sub_matrix_of_rows"]
