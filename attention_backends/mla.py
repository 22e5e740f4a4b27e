"""Latent attention (DeepSeek-V2's MLA): the interface a backend implements
to serve it, and the page its KV cache keeps.

A latent layer caches, per token, ONE vector: the compressed latent c_kv
(`kv_lora_rank`, after its RMSNorm) then the RoPE key k_pe
(`qk_rope_head_dim`, rotated, shared by every head). Each head's key and
value are linear in c_kv: k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv, the
per-head slices of the checkpoint's `kv_b_proj`.

Decode uses weight absorption (DeepSeek-V2, section 2.1.3): W_UK folds into
the query, q_lat_h = W_UK_h^T q_nope_h, a query in latent space; the scores
are q_lat_h . c_kv + q_pe_h . k_pe, the softmax-weighted sum of the cached
latents is taken once per head and W_UV_h maps it into the head's value
space. Nothing per head is ever expanded from the cache. A prefill may
expand instead (each implementation says which it does).

A backend declares `supports_mla` at registration (plugins/builtin.py) and
returns its impl from `AttentionBackend.get_mla_impl_cls`; the selector
gives a latent model only backends that declare it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from pagedllm.attention_backends.base import MLA_KV_CACHE_LAYOUT, MLAKVCacheLayout
from pagedllm.attention_backends.kv_cache_dtype import DEFAULT_KV_SCALE

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionMetadata


class MLAAttentionImpl(ABC):
    """Per-layer latent attention over the paged cache, for one rank's
    `num_heads` heads (tensor parallel splits the heads; every rank caches
    the same latents)."""

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        # qk_head_dim ** -0.5, times YaRN's mscale(all dims) squared where the config scales RoPE.
        self.scale = scale
        # An fp8 cache holds the latent / kv_scale (attention_backends/kv_cache_dtype.py).
        self.kv_scale = DEFAULT_KV_SCALE

    @abstractmethod
    def forward(
        self,
        q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [T, num_heads, qk_rope_head_dim], rotated
        kv_c_normed: torch.Tensor,  # [T, kv_lora_rank]
        k_pe: torch.Tensor,  # [T, qk_rope_head_dim], rotated
        kv_b_weight: torch.Tensor,  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
        kv_cache: torch.Tensor,  # MLAKVCacheLayout's shape
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, v_head_dim]
        """Write [kv_c_normed, k_pe] into the cache at slot_mapping (before
        any read, as AttentionImpl.forward does), then attend. `kv_b_weight`
        is this rank's `kv_b_proj` weight (the checkpoint's layout: per head,
        W_UK's rows then W_UV's), read at each forward so that a loaded or
        reloaded checkpoint is what runs."""

    def split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, qk_nope_head_dim, L], W_UV [H, v_head_dim, L]): views of `kv_b_weight`."""
        per_head = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, Dn] -> the query in latent space [T, H, L] (q_lat_h = W_UK_h^T q_nope_h)."""
    import torch

    return torch.einsum("thd,hdl->thl", q_nope, w_uk)


def unabsorb_output(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The softmax-weighted latents [T, H, L] -> each head's value [T, H, Dv]."""
    import torch

    return torch.einsum("thl,hvl->thv", latent_out, w_uv)


__all__ = ["MLA_KV_CACHE_LAYOUT", "MLAAttentionImpl", "MLAKVCacheLayout", "absorb_query", "unabsorb_output"]
