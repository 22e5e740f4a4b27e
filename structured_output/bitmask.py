"""The shared token-bitmask layout (see interface.py) and applying it to logits."""

from __future__ import annotations

from typing import Any

import torch

BITS_PER_WORD = 32
_xgrammar_apply: Any = None  # resolved on first use; False = not installed


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab_size / 32)], every token allowed (-1 = all bits)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [ceil(V / 32)] with bit t set where `allowed[t]` (bool [V])."""
    padded = torch.zeros(bitmask_width(len(allowed)) * BITS_PER_WORD, dtype=torch.int64)
    padded[: len(allowed)] = allowed.to(torch.int64)
    words = (padded.view(-1, BITS_PER_WORD) << torch.arange(BITS_PER_WORD, dtype=torch.int64)).sum(dim=1)
    # Two's complement: bit 31 set means a negative int32.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[rows[i], t] = -inf where bitmask[i] disallows token t.

    `logits` must be contiguous float32 [batch, vocab]; rows not listed are
    untouched. Uses xgrammar's kernel (CPU and CUDA) when it is installed,
    else plain torch.
    """
    global _xgrammar_apply
    if not rows:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if _xgrammar_apply is None:
        try:
            from xgrammar import apply_token_bitmask_inplace as xgr_apply

            _xgrammar_apply = xgr_apply
        except ImportError:
            _xgrammar_apply = False
    if _xgrammar_apply is not False and logits.dtype == torch.float32 and logits.is_contiguous():
        # xgrammar reads bitmask row i for logits row indices[i]; the bitmask
        # must have one row per logits row.
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
        full[rows] = bitmask
        _xgrammar_apply(logits, full, vocab_size=logits.shape[1], indices=rows)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
