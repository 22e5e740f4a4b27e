"""OLMo 2 (OLMo et al., 2024): Llama's modules with the norms moved.

- Post-norm blocks without an input norm:
  x + RMSNorm(Attn(x)), then x + RMSNorm(MLP(x)).
- QK-norm over the whole q and k projections (one RMSNorm num_heads *
  head_dim wide, one num_kv_heads * head_dim wide), before RoPE; not per
  head as in Qwen3.

Tensor parallel as Llama, except that the q/k norms span every rank's heads:
each rank normalizes its own columns with the sum of squares all-reduced
across ranks (layers/sharded_norm.py), one collective per layer for q and k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.sharded_norm import ShardedRMSNorm, sharded_rms_norms
from pagedllm.model_registry.models.llama import (
    LlamaAttention,
    LlamaFlags,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


class Olmo2Attention(LlamaAttention):
    # Llama's q_norm / k_norm (Qwen3's, per head) under the checkpoint's names, full width here.
    q_norm: ShardedRMSNorm  # type: ignore[assignment]
    k_norm: ShardedRMSNorm  # type: ignore[assignment]

    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__(hf_config, flags, layer_idx, attn_backend)
        qkv_proj, eps = self.qkv_proj, hf_config.rms_norm_eps
        # Rank r holds query heads r * num_heads ... and KV head(s) r // replicas ... (QKVParallelLinear).
        self.q_norm = ShardedRMSNorm(self.q_size * qkv_proj.tp_size, self.q_size, qkv_proj.tp_rank, eps)
        num_kv_shards = qkv_proj.tp_size // qkv_proj.num_kv_head_replicas
        self.k_norm = ShardedRMSNorm(
            self.kv_size * num_kv_shards, self.kv_size, qkv_proj.tp_rank // qkv_proj.num_kv_head_replicas, eps
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = sharded_rms_norms([self.q_norm, self.k_norm], [q, k])  # [T, H * D], [T, Hkv * D]
        q = self.rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = self.rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, attn_metadata)
        return self.o_proj(out)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.self_attn = Olmo2Attention(hf_config, flags, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.mlp = LlamaMLP(hf_config)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """(x, None): the residual is added here (the norms sit after each
        block, so there is no next pre-norm to fuse the add into)."""
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attn_metadata))
        x = x + self.post_feedforward_layernorm(self.mlp(x))
        return x, None


class Olmo2Model(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls: ClassVar[type[LlamaModel]] = Olmo2Model
