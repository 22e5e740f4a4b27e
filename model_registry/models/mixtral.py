"""Mixtral (Jiang et al., 2024): Mistral's attention (a sliding window from
the config on every layer) with every MLP a sparse mixture of experts,
`block_sparse_moe`: a router (`gate`) picks each token's top
`num_experts_per_tok` of `num_local_experts` and always renormalises their
softmax weights; each expert is a SwiGLU MLP of `intermediate_size` whose
checkpoint names its matrices `w1` (gate), `w2` (down) and `w3` (up).
Loading and tensor parallelism: as Qwen3-MoE's (qwen3_moe.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from pagedllm.model_registry.layers.fused_moe import MIXTRAL_EXPERT_NAMES
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.models.llama import LlamaAttention, LlamaFlags, LlamaModel
from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


class MixtralDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = LlamaAttention(hf_config, flags, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(hf_config, hf_config.num_local_experts, hf_config.intermediate_size,
                                               True, MIXTRAL_EXPERT_NAMES)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) as LlamaDecoderLayer's, the MLP being the experts."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, attn_metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.block_sparse_moe(h), residual


class MixtralModel(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = MixtralDecoderLayer


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags()
    model_cls: ClassVar[type[LlamaModel]] = MixtralModel
    expert_names: ClassVar[dict[str, str]] = MIXTRAL_EXPERT_NAMES
