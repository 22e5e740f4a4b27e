"""Granite (IBM, 2024): Llama's graph with four scalars from muP training.

- ``embedding_multiplier`` scales the token embeddings;
- ``residual_multiplier`` scales each block's output (attention, then MLP)
  before it is added to the residual stream;
- ``attention_multiplier`` is the attention scale, in place of head_dim**-0.5;
- ``logits_scaling`` divides the final logits.

Tensor parallel exactly as Llama: the multipliers are scalars, the same on
every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.models.llama import (
    LlamaAttention,
    LlamaFlags,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


class GraniteDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.residual_multiplier = float(hf_config.residual_multiplier)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            hf_config, flags, layer_idx, attn_backend, scale=float(hf_config.attention_multiplier)
        )
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.mlp = LlamaMLP(hf_config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as in LlamaDecoderLayer: h is the block's output
        already scaled, so the next norm's add is Granite's
        residual + h * residual_multiplier."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, attn_metadata) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = GraniteDecoderLayer

    def __init__(self, hf_config: Any, flags: LlamaFlags, attn_backend: type[AttentionBackend]):
        super().__init__(hf_config, flags, attn_backend)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls: ClassVar[type[LlamaModel]] = GraniteModel

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__(hf_config, attn_backend, dtype)
        self.logits_scaling = float(hf_config.logits_scaling)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # NOTE: a division, as transformers does: a multiply by 1/scaling rounds differently.
        return super().compute_logits(hidden_states) / self.logits_scaling
