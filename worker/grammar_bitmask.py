"""Applying a grammar's token bitmask to the logits of the rows that sample
under it (the layout: structured_output/bitmask.py)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.structured_output.bitmask import unpack_bitmask

_xgrammar_apply: Any = None  # resolved on first use; False = not installed


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
