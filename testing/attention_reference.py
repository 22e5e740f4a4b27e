"""Paged attention as plain torch, one request at a time: what every
backend's output is compared with (float32, on the CPU)."""

from __future__ import annotations

import torch


def reference_attention(
    query: torch.Tensor,  # [q_len, H, D]
    keys: torch.Tensor,  # [seq_len, Hkv, D], the whole context
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]: each head's sink logit, in the softmax, its probability dropped
) -> torch.Tensor:  # [q_len, H, D] float32
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().cpu().repeat_interleave(group, dim=1)  # [S, H, D]
    v = values.float().cpu().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", query.float().cpu(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    # query row i sits at absolute position seq_len - q_len + i (causal on positions)
    positions = torch.arange(seq_len - q_len, seq_len)[:, None]
    keys_at = torch.arange(seq_len)[None, :]
    allowed = keys_at <= positions
    if sliding_window is not None:
        allowed &= keys_at > positions - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), v)
    sink_column = sinks.float().cpu().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqs,shd->qhd", probs, v)
