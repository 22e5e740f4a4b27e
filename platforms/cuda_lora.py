"""The CUDA platform's kernels for the "lora" op (a LoRASlots layer's
shrink/expand, model_registry/layers/lora.py) in Triton, in punica's two
forms (Chen et al., 2023; vLLM's punica kernels):

- BGMV, for batches of fewer than SEGMENT_MIN_ROWS rows (decode): each
  row gathers its own adapter by its slot. shrink: one program per (row,
  BLOCK_R rank rows), h[t] = x[t] @ A[s].T over K in BLOCK_K tiles, float32
  sums into a float32 scratch [T, R]; expand: one program per (row, BLOCK_N
  output rows), y[t] += h[t] @ B[s].T reading only the rank block of each
  stacked sub-matrix (B is zero elsewhere), added in float32 and rounded
  once. No `tl.dot` (GEMV-shaped work).
- SGMV, for longer batches (prefill): the rows sorted by slot on the
  device (`group_rows_by_slot`), one program per (tile of one slot's rows,
  tile of R or of the outputs, slot) and tensor-core dots, so an adapter's
  weights are read once per tile of its rows, not once per row. Programs
  past a slot's rows return at once; the expand runs over the whole rank
  (the zero blocks cost flops, not correctness), h cast to the weights'
  dtype for it (float32 stays float32, IEEE dots).

A row whose slot is 0 gets nothing. The slots are read on the device and
the launch shapes depend only on T and the slot count, so both forms are
CUDA-graph safe: a replay follows whatever slots the runner wrote into its
buffer. float16 and bfloat16 run in the Triton interpreter for BGMV; SGMV's
`tl.dot` is wrong there in bfloat16, so it is checked in float32 and
float16 off a GPU.

Importing this module imports triton: the platform imports it only when a
layer on a CUDA device takes the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import triton
import triton.language as tl
from torch import nn

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_R, BLOCK_K, BLOCK_N = 16, 64, 64
# Batches of at least this many rows take the segment (SGMV) kernels, whose
# tensor-core dots read each adapter once per tile of rows; smaller ones the
# per-row (BGMV) kernels. Not tuned on a GPU yet.
SEGMENT_MIN_ROWS = 64
SEGMENT_BLOCK_M, SEGMENT_BLOCK_K = 16, 32


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


@triton.jit
def _lora_shrink_segments_kernel(
    x_ptr,  # [T, K], rows stride_xm apart
    rows_ptr,  # int32 [T]: row indices sorted by slot
    counts_ptr,  # int64 [S + 1]: rows per slot
    starts_ptr,  # int64 [S + 1]: each slot's first position in rows_ptr
    a_ptr,  # [S + 1, R, K] contiguous
    h_ptr,  # float32 [T, R] contiguous
    K,
    R,
    stride_xm,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(2) + 1
    count = tl.load(counts_ptr + slot)
    m_start = tl.program_id(0) * BLOCK_M
    if m_start < count:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < count
        rows = tl.load(rows_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        a_slot = a_ptr + slot.to(tl.int64) * R * K
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            offs_k = k_start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xs = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            a = tl.load(a_slot + offs_r[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_R]: A[s].T's tile
            if IEEE_DOT:  # noqa: SIM108 - a constexpr branch: each compiled kernel keeps one dot
                acc = tl.dot(xs, a, acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, a, acc)
        tl.store(h_ptr + rows[:, None] * R + offs_r[None, :], acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_segments_kernel(
    h_ptr,  # float32 [T, R]
    rows_ptr,  # int32 [T]: row indices sorted by slot
    counts_ptr,  # int64 [S + 1]
    starts_ptr,  # int64 [S + 1]
    b_ptr,  # [S + 1, N, R] contiguous
    y_ptr,  # [T, N], rows stride_ym apart
    N,
    R,
    stride_ym,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_RANKS: tl.constexpr,  # R rounded up to a power of two (>= 16)
):
    slot = tl.program_id(2) + 1
    count = tl.load(counts_ptr + slot)
    m_start = tl.program_id(0) * BLOCK_M
    if m_start < count:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_ok = offs_m < count
        rows = tl.load(rows_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_r = tl.arange(0, BLOCK_RANKS)
        r_ok = offs_r < R
        # the whole rank: B is zero outside each sub-matrix's own block
        h = tl.load(h_ptr + rows[:, None] * R + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot.to(tl.int64) * N * R + offs_n[None, :] * R + offs_r[:, None],
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_RANKS, BLOCK_N]: B[s].T's tile
        if IEEE_DOT:  # noqa: SIM108 - a constexpr branch: each compiled kernel keeps one dot
            delta = tl.dot(h, b.to(tl.float32), input_precision="ieee")
        else:
            delta = tl.dot(h.to(b.dtype), b)
        y_tile = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


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
    if y.stride(-1) != 1 or not (lora_a.is_contiguous() and lora_b.is_contiguous()):  # the kernels' addressing
        raise ValueError("LoRA kernels need y's rows and the slot buffers contiguous")
    slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
    shrunk = torch.empty(num_rows, rank_total, dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(num_rows, triton.cdiv(rank_total, BLOCK_R))](
        x, slots, lora_a, shrunk, num_in, rank_total, x.stride(0), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    _lora_expand_kernel[(num_rows, triton.cdiv(num_out, BLOCK_N))](
        shrunk, slots, lora_b, sub_of_row, y, num_out, rank_total, max_rank, y.stride(0), BLOCK_N=BLOCK_N,
        BLOCK_RANK=triton.next_power_of_2(max_rank),
    )


def group_rows_by_slot(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row indices sorted by slot int32 [T], rows per slot int64 [S + 1],
    each slot's first position) on the device, with no host read (bincount
    would read the largest slot on the host)."""
    slots = token_slots.to(torch.int64)
    sorted_rows = torch.argsort(slots, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots, dtype=torch.int64, device=slots.device).scatter_add_(0, slots,
                                                                                      torch.ones_like(slots))
    return sorted_rows, counts, torch.cumsum(counts, 0) - counts


def lora_shrink_expand_segments(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor,
                                lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """As lora_shrink_expand, one tile of up to SEGMENT_BLOCK_M rows of one
    slot per program (punica's SGMV): the rows grouped by slot on the
    device, the adapter's tiles read once per tile of rows, tensor-core dots."""
    num_rows, num_in = x.shape
    num_slots, rank_total, _ = lora_a.shape
    num_out = lora_b.shape[1]
    if token_slots.shape != (num_rows,) or y.shape != (num_rows, num_out):  # the kernels read T slots and rows
        raise ValueError(f"LoRA rows: x {tuple(x.shape)}, y {tuple(y.shape)}, slots {tuple(token_slots.shape)}")
    if num_rows == 0 or num_slots == 1:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1 or not (lora_a.is_contiguous() and lora_b.is_contiguous()):  # the kernels' addressing
        raise ValueError("LoRA kernels need y's rows and the slot buffers contiguous")
    sorted_rows, counts, starts = group_rows_by_slot(token_slots, num_slots)
    shrunk = torch.empty(num_rows, rank_total, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32
    row_tiles = triton.cdiv(num_rows, SEGMENT_BLOCK_M)
    _lora_shrink_segments_kernel[(row_tiles, triton.cdiv(rank_total, BLOCK_R), num_slots - 1)](
        x, sorted_rows, counts, starts, lora_a, shrunk, num_in, rank_total, x.stride(0), IEEE_DOT=ieee,
        BLOCK_M=SEGMENT_BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=SEGMENT_BLOCK_K,
    )
    _lora_expand_segments_kernel[(row_tiles, triton.cdiv(num_out, BLOCK_N), num_slots - 1)](
        shrunk, sorted_rows, counts, starts, lora_b, y, num_out, rank_total, y.stride(0), IEEE_DOT=ieee,
        BLOCK_M=SEGMENT_BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_RANKS=max(16, triton.next_power_of_2(rank_total)),
    )


def build(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The "lora" kernel of a LoRASlots layer on the CUDA device."""
    sub_of_row = sub_matrix_of_rows(list(layer.output_sizes), layer.lora_b.device)  # type: ignore[arg-type]
    max_rank = int(layer.max_rank)  # type: ignore[arg-type]

    def add_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor) -> None:
        lora_a, lora_b = cast(torch.Tensor, layer.lora_a), cast(torch.Tensor, layer.lora_b)
        if x.shape[0] >= SEGMENT_MIN_ROWS:  # a host shape: the same choice at capture and replay
            lora_shrink_expand_segments(y, x, token_slots, lora_a, lora_b)
        else:
            lora_shrink_expand(y, x, token_slots, lora_a, lora_b, sub_of_row, max_rank)

    return add_lora


__all__ = ["SEGMENT_MIN_ROWS", "build", "group_rows_by_slot", "lora_shrink_expand", "lora_shrink_expand_segments",
           "sub_matrix_of_rows"]
