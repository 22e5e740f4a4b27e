"""DeepSeek-V2 and DeepSeek-V3 (DeepSeek-AI, 2024): Llama's pre-norm decoder
with multi-head latent attention (deepseek_v2_attention.py) and, after the
first `first_k_dense_replace` dense layers, a mixture of experts.

MoE block: `n_routed_experts` routed experts (one FusedMoE,
layers/fused_moe.py), each token's top `num_experts_per_tok`, plus
`n_shared_experts` shared experts that every token runs (one SwiGLU MLP of
n_shared_experts x moe_intermediate_size). Routing (layers/moe_router.py):

- V2: softmax scores; `topk_method` greedy, or group_limited_greedy (the
  best `topk_group` of `n_group` groups by their best expert); weights not
  renormalised; times `routed_scaling_factor`.
- V3: sigmoid scores; `gate.e_score_correction_bias` added for choosing only
  (noaux_tc: groups by the sum of their two best biased scores); the chosen
  unbiased scores renormalised when `norm_topk_prob`; times
  `routed_scaling_factor`.

Tensor parallel: attention heads split per rank, the latent cache
replicated; the routed and shared experts' intermediate dims split, their
partial sums added and all-reduced once (as Qwen2-MoE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.attention_backends.base import AttentionRequirements
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.fused_moe import QWEN_EXPERT_NAMES, FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig, RouterLinear
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.models.deepseek_v2_attention import DeepseekV2MLAAttention
from pagedllm.model_registry.models.llama import LlamaDecoderLayer, LlamaFlags, LlamaMLP, LlamaModel
from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.model_registry.layers.attention import Attention


def deepseek_router(hf_config: Any) -> RouterConfig:
    """The routing of a V2 or V3 config. DeepSeek's own config.json names
    `scoring_func` and `topk_method`; transformers' V3 config has neither
    (its router is sigmoid + noaux_tc), its V2 config no `scoring_func`.
    `norm_topk_prob` is honoured for both, as DeepSeek's reference code does
    (transformers' V2 router ignores it; V2 checkpoints set it false)."""
    is_v3 = getattr(hf_config, "model_type", "") == "deepseek_v3"
    scoring = getattr(hf_config, "scoring_func", None) or ("sigmoid" if is_v3 else "softmax")
    topk_method = getattr(hf_config, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    return RouterConfig(
        hf_config.n_routed_experts, hf_config.num_experts_per_tok, scoring=scoring,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        num_expert_group=hf_config.n_group if grouped else None,
        topk_group=hf_config.topk_group if grouped else None,
        routed_scaling_factor=float(hf_config.routed_scaling_factor),
    )


def uses_correction_bias(hf_config: Any) -> bool:
    """noaux_tc (V3): the checkpoint's `gate.e_score_correction_bias` picks the experts."""
    is_v3 = getattr(hf_config, "model_type", "") == "deepseek_v3"
    return (getattr(hf_config, "topk_method", None) or ("noaux_tc" if is_v3 else "greedy")) == "noaux_tc"


class DeepseekV2MoE(nn.Module):
    """Router, routed experts and shared experts: [T, hidden] -> [T, hidden]."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        router = deepseek_router(hf_config)
        self.gate = RouterLinear(hf_config.hidden_size, router.num_experts, bias=False)
        if uses_correction_bias(hf_config):  # V3: the checkpoint's gate.e_score_correction_bias
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(router.num_experts), requires_grad=False)
        self.experts = FusedMoE(router, hf_config.hidden_size, hf_config.moe_intermediate_size,
                                activation=hf_config.hidden_act, reduce_results=False, expert_names=QWEN_EXPERT_NAMES)
        num_shared = getattr(hf_config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(hf_config, hf_config.moe_intermediate_size * num_shared, reduce_results=False)
                               if num_shared else None)
        self.tp_group = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        # transformers' router runs in float32 (weights and activations).
        router_logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        out = self.experts(x, router_logits, bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp_group.all_reduce(out) if self.tp_group.world_size > 1 else out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = DeepseekV2MLAAttention(hf_config, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        is_dense = layer_idx < (getattr(hf_config, "first_k_dense_replace", 0) or 0)
        self.mlp: nn.Module = LlamaMLP(hf_config) if is_dense else DeepseekV2MoE(hf_config)

    # Llama's pre-norm block over the same four modules: (h, residual).
    forward = LlamaDecoderLayer.forward


class DeepseekV2Model(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = DeepseekV2DecoderLayer


class DeepseekV2ForCausalLM(Qwen3MoeForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags()
    model_cls: ClassVar[type[LlamaModel]] = DeepseekV2Model
    expert_names: ClassVar[dict[str, str]] = QWEN_EXPERT_NAMES
    # No stacked q/k/v: the latent projections load as themselves.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def attention_requirements(cls, hf_config: Any) -> AttentionRequirements:
        latent_size = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim
        return AttentionRequirements((latent_size,), latent_kv_size=latent_size)

    def get_attention_layers(self) -> list[Attention]:
        return [cast(DeepseekV2DecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def is_ignored_weight(self, name: str) -> bool:
        """Also V3's multi-token-prediction layer (`model.layers.<num_hidden_layers>`):
        a drafter's weights, not the model's."""
        prefix = f"model.layers.{self.config.num_hidden_layers}."
        return name.startswith(prefix) or super().is_ignored_weight(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3's config differs (sigmoid routing, `rope_interleave`); the graph is V2's."""


__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "FusedMoE"]
