"""GPT-OSS (OpenAI, 2025): a pre-norm mixture-of-experts decoder.

Attention: grouped-query with biases on q/k/v/o, rotary positions (YaRN in
the released checkpoints, through the shared rotary layer), layers that
alternate a 128-token sliding window and full attention (`layer_types`),
and per-head attention sinks: one learned logit per query head joins each
row's softmax and its probability is dropped (the backend applies them;
the selector only picks a backend that declares `supports_sinks`).

MLP: a router (linear with bias) picks the top-k experts of each token and
softmaxes their logits; each expert is a clamped SwiGLU (alpha 1.702,
`swiglu_limit`) whose gate and up columns are interleaved in one
`gate_up_proj` [E, hidden, 2 * inter], as transformers stores them.

The experts are one FusedMoE layer (layers/fused_moe.py): the platform's
MoE kernel runs them. The released checkpoints store the expert matrices as
MXFP4 (`quantization_config.quant_method` "mxfp4": `<proj>_blocks` and
`<proj>_scales` instead of `<proj>`, model_registry/mxfp4.py); they are
dequantized at load, one expert at a time, and run in the compute dtype.

Tensor parallel: attention heads and their sinks are split per rank like
Llama's; the router is replicated and each expert's intermediate dimension
is split (the MoE layer all-reduces its output); with
`enable_expert_parallel` each rank holds whole experts, their biases whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.attention_backends.base import AttentionRequirements
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.linear import QKVParallelLinear, RowParallelLinear, copy_shard
from pagedllm.model_registry.layers.logits_head import LogitsHead
from pagedllm.model_registry.layers.moe_router import RouterConfig, RouterLinear
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.rotary import ApplyRotaryEmb, RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_registry.loader import checkpoint_quant_method
from pagedllm.model_registry.models.llama import LlamaDecoderLayer, LlamaForCausalLM, packed_param_name
from pagedllm.model_registry.mxfp4 import dequantize_mxfp4_matrix

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


def _layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    layer_types = getattr(hf_config, "layer_types", None) or []
    is_sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
    return hf_config.sliding_window if is_sliding else None


class GptOssAttention(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        self.head_dim = hf_config.head_dim
        bias = hf_config.attention_bias
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads,
                                          hf_config.num_key_value_heads, bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=bias)
        # This rank's query heads' sink logits [num_heads]; the checkpoint holds every head's.
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.rotary = ApplyRotaryEmb()
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, attn_backend,
            sliding_window=_layer_sliding_window(hf_config, layer_idx), sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        tp = get_tp_group()
        copy_shard(param, loaded_weight, 0, tp.rank_in_group * self.num_heads, self.num_heads * tp.world_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :]
        # q and k side by side in qkv: one rotary pass over both heads' rows.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        q, k = self.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, attn_metadata)
        return self.o_proj(out)


# The checkpoint tensors of the experts' parameters: float, or MXFP4 blocks and scales.
FLOAT_EXPERT_NAMES: dict[str, tuple[str, ...]] = {"w13_weight": ("gate_up_proj",),
                                                 "w13_bias": ("gate_up_proj_bias",),
                                                 "w2_weight": ("down_proj",), "w2_bias": ("down_proj_bias",)}
MXFP4_EXPERT_NAMES: dict[str, tuple[str, ...]] = {
    **FLOAT_EXPERT_NAMES, "w13_weight": ("gate_up_proj_blocks", "gate_up_proj_scales"),
    "w2_weight": ("down_proj_blocks", "down_proj_scales")}


class GptOssMLP(nn.Module):
    """The router (a linear with bias: top-k of its logits, softmaxed) and
    the experts as one FusedMoE with GPT-OSS's clamped SwiGLU."""

    def __init__(self, hf_config: Any):
        super().__init__()
        num_experts = hf_config.num_local_experts
        self.router = RouterLinear(hf_config.hidden_size, num_experts, bias=True)
        mxfp4 = checkpoint_quant_method(hf_config) == "mxfp4"
        self.experts = FusedMoE(
            RouterConfig(num_experts, hf_config.num_experts_per_tok), hf_config.hidden_size,
            hf_config.intermediate_size, bias=True, activation="swigluoai",
            swiglu_alpha=getattr(hf_config, "swiglu_alpha", 1.702), swiglu_limit=hf_config.swiglu_limit,
            stacked_names=MXFP4_EXPERT_NAMES if mxfp4 else FLOAT_EXPERT_NAMES,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


def _load_expert(experts: FusedMoE, proj: str, bias: bool, expert: int, tensor: torch.Tensor) -> None:
    """One expert's tensor in transformers' layout: gate_up_proj [hidden,
    2 * inter] (x @ W, gate_j at column 2j, up_j at 2j + 1) or its bias
    [2 * inter], down_proj [inter, hidden] or its bias [hidden]."""
    if proj == "gate_up_proj":
        param = cast(nn.Parameter, experts.w13_bias if bias else experts.w13_weight)
        gate, up = (tensor[::2], tensor[1::2]) if bias else (tensor[:, ::2].t(), tensor[:, 1::2].t())
        experts.weight_loader(param, gate, "w1", expert)
        experts.weight_loader(param, up, "w3", expert)
    else:
        param = cast(nn.Parameter, experts.w2_bias if bias else experts.w2_weight)
        experts.weight_loader(param, tensor if bias else tensor.t(), "w2", expert)


def _param_name(proj: str, bias: bool) -> str:
    return ("w13" if proj == "gate_up_proj" else "w2") + ("_bias" if bias else "_weight")


def _expert_tensor_kind(name: str) -> tuple[str, str]:
    """('gate_up_proj' | 'down_proj', the suffix: '' | '_bias' | '_blocks' | '_scales')."""
    kind = name.rsplit(".", 1)[-1]
    for proj in ("gate_up_proj", "down_proj"):
        if kind.startswith(proj) and kind[len(proj):] in ("", "_bias", "_blocks", "_scales"):
            return proj, kind[len(proj):]
    raise ValueError(f"unexpected GPT-OSS expert tensor {name!r}")


def load_gpt_oss_experts(experts: FusedMoE, name: str, tensor: torch.Tensor) -> str:
    """transformers' stacked float expert tensors into `experts`:
    gate_up_proj [E, hidden, 2 * inter] and its bias [E, 2 * inter],
    down_proj [E, inter, hidden] and its bias; returns the parameter's name
    within the FusedMoE."""
    proj, suffix = _expert_tensor_kind(name)
    for expert in range(tensor.shape[0]):
        _load_expert(experts, proj, suffix == "_bias", expert, tensor[expert])
    return _param_name(proj, suffix == "_bias")


def load_gpt_oss_mxfp4_experts(experts: FusedMoE, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> str:
    """The MXFP4 expert matrices into `experts`, dequantized one expert at
    a time (a float32 copy of one expert's matrix at most): gate_up_proj
    blocks [E, 2 * inter, hidden / 32, 16] (rows interleaved gate, up),
    down_proj blocks [E, hidden, inter / 32, 16], nn.Linear's [out, in]
    layout; returns the parameter's name within the FusedMoE."""
    proj, _ = _expert_tensor_kind(name)
    hidden, inter = experts.hidden_size, experts.intermediate_size
    shape = (2 * inter, hidden) if proj == "gate_up_proj" else (hidden, inter)
    if blocks.shape[0] != experts.num_experts:
        raise ValueError(f"shape mismatch: model expects {experts.num_experts} experts in {name}, "
                         f"checkpoint has {blocks.shape[0]}")
    for expert in range(experts.num_experts):
        weight = dequantize_mxfp4_matrix(blocks[expert], scales[expert], shape)
        _load_expert(experts, proj, False, expert, weight.t())  # transformers' [in, out] layout
    return _param_name(proj, False)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = GptOssAttention(hf_config, layer_idx, attn_backend)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.mlp = GptOssMLP(hf_config)

    # Llama's pre-norm block over the same four modules: (h, residual).
    forward = LlamaDecoderLayer.forward


class GptOssModel(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(hf_config, i, attn_backend) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            hf_config.head_dim, hf_config.max_position_embeddings, get_rope_parameters(hf_config)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)  # shared by every layer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, cos, sin, attn_metadata, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class GptOssForCausalLM(ModelForCausalLM):
    supports_tensor_parallel: ClassVar[bool] = True
    # config.json's quantization_config.quant_method values it loads (the loader refuses others).
    checkpoint_quant_methods: ClassVar[tuple[str, ...]] = ("mxfp4",)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
    }

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = hf_config
        self.model = GptOssModel(hf_config, attn_backend)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.logits_head = LogitsHead(hf_config.vocab_size)
        self.to(dtype)

    @classmethod
    def attention_requirements(cls, hf_config: Any) -> AttentionRequirements:
        windows = [w for i in range(hf_config.num_hidden_layers) if (w := _layer_sliding_window(hf_config, i))]
        return AttentionRequirements((hf_config.head_dim,), min(windows, default=None), None, sinks=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_head(self.lm_head, hidden_states).float()

    def get_attention_layers(self) -> list[Attention]:
        return [cast(GptOssDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def is_ignored_weight(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's loader (q/k/v into the fused qkv_proj, each tensor
        through its parameter's weight_loader), the experts' stacked tensors
        through `load_gpt_oss_experts` (MXFP4: `load_gpt_oss_mxfp4_experts`,
        each `_blocks` with its `_scales`)."""
        expert_tensors: dict[str, torch.Tensor] = {}
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if ".mlp.experts." in name:
                expert_tensors[name] = tensor
            else:
                rest.append((name, tensor))
        loaded = LlamaForCausalLM.load_weights(self, rest)  # type: ignore[arg-type]
        modules = dict(self.named_modules())
        for name, tensor in expert_tensors.items():
            module_name = name[: name.index(".mlp.experts.") + len(".mlp.experts")]
            experts = cast(FusedMoE, modules[module_name])
            _, suffix = _expert_tensor_kind(name)
            if suffix == "_scales":
                continue  # read with its blocks
            if suffix == "_blocks":
                scales = expert_tensors.get(name.removesuffix("_blocks") + "_scales")
                if scales is None:
                    continue  # the strict loader names it missing
                loaded.add(f"{module_name}.{load_gpt_oss_mxfp4_experts(experts, name, tensor, scales)}")
            else:
                loaded.add(f"{module_name}.{load_gpt_oss_experts(experts, name, tensor)}")
        return loaded

    @classmethod
    def checkpoint_to_param_name(cls, name: str) -> tuple[str, int | None]:
        return packed_param_name(name, cls.packed_modules_mapping)
