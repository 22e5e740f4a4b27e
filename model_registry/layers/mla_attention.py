"""The latent attention layer (DeepSeek's MLA): holds the paged cache of one
latent vector per token and delegates to the backend's MLA impl
(attention_backends/mla.py). The projections live in the model.

It is an `Attention` to the engine (the KV cache is allocated and bound,
and its group read, the same way), with one KV "head" of
kv_lora_rank + qk_rope_head_dim: on every tensor-parallel rank the same
latents, whatever heads the rank computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.core.kv_cache.kv_cache_interface import MLAAttentionSpec
from pagedllm.model_registry.layers.attention import Attention

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.attention_backends.mla import MLAAttentionImpl


class MLAAttention(Attention):
    def __init__(
        self,
        num_heads: int,  # this rank's
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        attn_backend: type[AttentionBackend],
    ) -> None:
        # NOTE: not Attention.__init__: that builds a per-head K/V impl.
        nn.Module.__init__(self)
        self.num_heads = num_heads
        self.num_kv_heads = 1  # the latent, shared by every head
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.sliding_window = None
        self.mla_impl: MLAAttentionImpl = attn_backend.get_mla_impl_cls()(
            num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale
        )
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0

    def get_kv_cache_spec(self, block_size: int) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    def forward(  # type: ignore[override]
        self,
        q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, num_heads, qk_rope_head_dim], rotated
        kv_c_normed: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # this rank's kv_b_proj weight
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * v_head_dim]
        if self.kv_cache is None:
            raise RuntimeError("MLAAttention.kv_cache is not bound; the model runner sets it before the first forward")
        if self.kv_cache_group:
            attn_metadata = attn_metadata.kv_cache_groups[self.kv_cache_group - 1]
        out = self.mla_impl.forward(q_nope, q_pe, kv_c_normed, k_pe, kv_b_weight, self.kv_cache, attn_metadata)
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_head_dim)
