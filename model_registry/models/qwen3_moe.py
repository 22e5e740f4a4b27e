"""Qwen3-MoE (Yang et al., 2025): Qwen3's attention (q/k norms) with the MLP
of most layers a sparse mixture of experts; also the base of Qwen2-MoE and
Mixtral, which differ in the block and the checkpoint's names.

A sparse block: a router (`gate`, a linear without bias) scores the
`num_experts` experts; each token's top `num_experts_per_tok` (softmax,
renormalised to sum to 1 when `norm_topk_prob`) run as one FusedMoE layer
(layers/fused_moe.py), each a SwiGLU MLP of `moe_intermediate_size`. A layer
in `mlp_only_layers`, or not on a multiple of `decoder_sparse_step`, keeps
Llama's dense MLP of `intermediate_size`.

Checkpoint: each expert's matrices apart (`mlp.experts.<e>.gate_proj` ...),
loaded into the FusedMoE's stacked w13/w2 by `expert_param_name`.

Tensor parallel: attention as Llama's; the router is replicated, every
expert's intermediate dimension split, one all-reduce per block (with
`enable_expert_parallel`, whole experts per rank instead: fused_moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.model_registry.layers.fused_moe import QWEN_EXPERT_NAMES, FusedMoE, expert_param_name
from pagedllm.model_registry.layers.moe_router import RouterConfig, RouterLinear
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaFlags,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


class SparseMoeBlock(nn.Module):
    """The router and the routed experts: [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        hf_config: Any,
        num_experts: int,
        intermediate_size: int,
        renormalize: bool,
        expert_names: dict[str, str],
        reduce_results: bool = True,
    ):
        super().__init__()
        self.gate = RouterLinear(hf_config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(
            RouterConfig(num_experts, hf_config.num_experts_per_tok, renormalize=renormalize),
            hf_config.hidden_size, intermediate_size, activation=getattr(hf_config, "hidden_act", "silu"),
            reduce_results=reduce_results, expert_names=expert_names,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """Qwen-MoE's rule (transformers' and vLLM's): which layers have experts."""
    return (
        layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer_idx + 1) % getattr(hf_config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = LlamaAttention(hf_config, flags, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.mlp = self.sparse_block(hf_config) if is_sparse_layer(hf_config, layer_idx) else LlamaMLP(hf_config)

    def sparse_block(self, hf_config: Any) -> nn.Module:
        return SparseMoeBlock(hf_config, hf_config.num_experts, hf_config.moe_intermediate_size,
                              bool(hf_config.norm_topk_prob), QWEN_EXPERT_NAMES)

    # Llama's pre-norm block over the same four modules: (h, residual).
    forward = LlamaDecoderLayer.forward


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags(qk_norm=True)
    model_cls: ClassVar[type[LlamaModel]] = Qwen3MoeModel
    # The checkpoint's names of an expert's gate, down and up matrices.
    expert_names: ClassVar[dict[str, str]] = QWEN_EXPERT_NAMES

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each expert's matrix into its FusedMoE's stacked parameter; the
        rest through Llama's loader."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def non_expert() -> Iterator[tuple[str, torch.Tensor]]:
            """Loads the expert tensors on the way; yields the rest to Llama's loader."""
            for name, tensor in weights:
                target = expert_param_name(name, self.expert_names)
                if target is None:
                    yield name, tensor
                    continue
                param_name, shard_id, expert_id = target
                param = params[param_name]
                cast(Any, param).weight_loader(param, tensor, shard_id, expert_id)
                loaded.add(param_name)

        return super().load_weights(non_expert()) | loaded
