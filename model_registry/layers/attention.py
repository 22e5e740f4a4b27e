"""The attention layer: projections live in the model, this holds the paged
KV cache binding and delegates to the selected backend's impl."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.core.kv_cache.kv_cache_interface import AnyKVCacheSpec, FullAttentionSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        attn_backend: type[AttentionBackend],
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        # `sinks` ([num_heads] of this rank, the model's parameter) only when
        # set: a backend written before sinks takes no such argument (the
        # selector gives a model with sinks only backends that declare them).
        extra = {} if sinks is None else {"sinks": sinks}
        self.impl = attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            **extra,
        )
        # NOTE: bound by the model runner after it allocates the cache
        # (backend.get_kv_cache_shape(...)); not a buffer, so never saved.
        self.kv_cache: torch.Tensor | None = None
        # The KV cache group whose block table this layer reads (bound with
        # the cache; model_registry/kv_cache.py). 0: the metadata passed in.
        self.kv_cache_group = 0

    def get_kv_cache_spec(self, block_size: int) -> AnyKVCacheSpec:
        """What this layer keeps in the KV cache (core/kv_cache/kv_cache_interface.py)."""
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, sliding_window=self.sliding_window)
        return FullAttentionSpec(block_size)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_size]
        k: torch.Tensor,  # [T, num_kv_heads * head_size]
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_size]
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not bound; the model runner sets it before the first forward")
        if self.kv_cache_group:
            attn_metadata = attn_metadata.kv_cache_groups[self.kv_cache_group - 1]
        num_tokens = q.shape[0]
        out = self.impl.forward(
            q.reshape(num_tokens, self.num_heads, self.head_size),
            k.reshape(num_tokens, self.num_kv_heads, self.head_size),
            v.reshape(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            attn_metadata,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)
