"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on
q/k/v) and Qwen3-MoE's sparse layers, each with a shared expert beside the
routed ones: a dense SwiGLU MLP of `shared_expert_intermediate_size` that
every token runs, scaled by sigmoid(shared_expert_gate(x)) (one logit per
token) and added to the routed experts' sum. `norm_topk_prob` defaults to
false here: the top-k softmax weights are not renormalised.

Tensor parallel: the routed experts and the shared expert each leave this
rank's partial sum; the block adds them and all-reduces once (the sigmoid
gate is replicated, so scaling a partial sum scales the whole).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.fused_moe import QWEN_EXPERT_NAMES
from pagedllm.model_registry.layers.moe_router import RouterLinear
from pagedllm.model_registry.models.llama import LlamaFlags, LlamaMLP, LlamaModel
from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM, SparseMoeBlock


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, hf_config: Any):
        super().__init__(hf_config, hf_config.num_experts, hf_config.moe_intermediate_size,
                         bool(hf_config.norm_topk_prob), QWEN_EXPERT_NAMES, reduce_results=False)
        self.shared_expert = LlamaMLP(hf_config, hf_config.shared_expert_intermediate_size, reduce_results=False)
        self.shared_expert_gate = RouterLinear(hf_config.hidden_size, 1, bias=False)
        self.tp_group = get_tp_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self.experts(x, self.gate(x)) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp_group.all_reduce(out) if self.tp_group.world_size > 1 else out


class Qwen2MoeDecoderLayer(Qwen3MoeDecoderLayer):
    def sparse_block(self, hf_config: Any) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(hf_config)


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls: ClassVar[type[nn.Module]] = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags(qkv_bias=True, o_proj_bias=False)
    model_cls: ClassVar[type[LlamaModel]] = Qwen2MoeModel
