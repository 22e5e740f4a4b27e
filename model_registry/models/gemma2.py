"""Gemma 2 (Gemma Team, 2024); Gemma 3's text model flips the flags in `GemmaFlags`.

Llama's decoder with these changes, each as transformers computes it:
- RMSNorm scales by (1 + w) (`GemmaRMSNorm`), and every layer has four:
  before attention, after it, before the MLP and after it (sandwich norms);
- GeGLU: the MLP's gate is a GELU (`hidden_activation`, tanh-approximated);
- embeddings are multiplied by sqrt(hidden_size) rounded to the model's
  dtype, as the checkpoints were trained;
- attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- logits soft-capped, cap * tanh(x / cap): the attention scores
  (`attn_logit_softcapping`, in the backend) and the output logits
  (`final_logit_softcapping`, in the LogitsHead);
- sliding-window and global layers as `layer_types` says (Gemma 2:
  alternating, starting with a sliding one); tied embeddings by default.

Tensor parallel as Llama: each rank holds num_heads / tp query heads and
their KV heads (qkv_proj column-, o_proj row-parallel), 1/tp of the MLP and
of the vocabulary; norms over the hidden size are replicated, and the q/k
norms and rotary are per head, so they apply per rank unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.model_registry.layers.activation import GeluAndMul
from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_registry.layers.logits_head import LogitsHead
from pagedllm.model_registry.layers.norm import GemmaRMSNorm
from pagedllm.model_registry.layers.rotary import ApplyRotaryEmb, RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_registry.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata

# transformers' activation names -> torch's `approximate` of F.gelu
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class GemmaFlags:
    """What Gemma 2 and Gemma 3 (text) differ in."""

    qk_norm: bool = False  # Gemma 3: a GemmaRMSNorm over each head of q and k before RoPE
    # Gemma 3's attention does not cap its scores whatever the config says
    # (transformers' Gemma3Attention never passes the cap on; vLLM neither).
    attn_soft_cap: bool = True
    # Gemma 3: rope_parameters keyed by layer type (the sliding layers' base is
    # rope_local_base_freq, the global layers' carry the scaling).
    rope_per_layer_type: bool = False


def _rope_parameters(hf_config: Any, layer_type: str) -> dict[str, Any]:
    """The rope parameters of one layer type, from transformers' per-type
    layout ({"sliding_attention": {...}, "full_attention": {...}})."""
    return get_rope_parameters(SimpleNamespace(rope_parameters=hf_config.rope_parameters[layer_type]))


def _check_supported(hf_config: Any) -> None:
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise ConfigError("use_bidirectional_attention", True, "false (pagedllm serves causal decoders)")
    activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if activation not in GELU_APPROXIMATIONS:
        raise ConfigError("hidden_activation", activation, ", ".join(GELU_APPROXIMATIONS))


class GemmaMLP(nn.Module):
    def __init__(self, hf_config: Any):
        super().__init__()
        intermediate_size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [intermediate_size, intermediate_size], bias=False
        )
        activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.act_fn = GeluAndMul(approximate=GELU_APPROXIMATIONS[activation])
        self.down_proj = RowParallelLinear(intermediate_size, hf_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(nn.Module):
    def __init__(
        self, hf_config: Any, flags: GemmaFlags, layer_type: str, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        total_num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden_size // total_num_heads
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, bias)
        # This rank's heads and their q / k / v widths.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=bias)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
        self.rotary = ApplyRotaryEmb()
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            hf_config.query_pre_attn_scalar**-0.5,
            self.num_kv_heads,
            attn_backend,
            sliding_window=hf_config.sliding_window if layer_type == SLIDING else None,
            logits_soft_cap=hf_config.attn_logit_softcapping if flags.attn_soft_cap else None,
        )

    # The same attributes as LlamaAttention (qkv_proj, q/k norms, rotary,
    # attn, o_proj), so the same forward; the scale, cap and window live in attn.
    forward = LlamaAttention.forward


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self, hf_config: Any, flags: GemmaFlags, layer_type: str, attn_backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        hidden_size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps=eps)
        self.self_attn = Gemma2Attention(hf_config, flags, layer_type, attn_backend)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps=eps)
        self.mlp = GemmaMLP(hf_config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) with the layer's output h + residual, as Llama's:
        the sandwich norms' outputs are what is added to the stream."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, attn_metadata))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma2Model(nn.Module):
    normalizer: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, hf_config: Any, flags: GemmaFlags, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        _check_supported(hf_config)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        # sqrt(hidden) in the model's dtype once the model is cast (transformers
        # rounds it the same way: the checkpoints were trained with it).
        self.register_buffer("normalizer", torch.tensor(hf_config.hidden_size**0.5), persistent=False)
        # transformers' config classes fill layer_types in (from sliding_window_pattern, or alternating)
        self.layer_types: list[str] = list(hf_config.layer_types)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(hf_config, flags, layer_type, attn_backend) for layer_type in self.layer_types
        )
        self.norm = GemmaRMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        # One cos/sin table per rope variant; each layer's key names its table.
        if flags.rope_per_layer_type:
            tables = {layer_type: _rope_parameters(hf_config, layer_type) for layer_type in set(self.layer_types)}
            self.rope_keys = list(self.layer_types)
        else:
            tables = {"default": get_rope_parameters(hf_config)}
            self.rope_keys = ["default"] * len(self.layer_types)
        max_position = hf_config.max_position_embeddings
        self.rotary_emb = nn.ModuleDict(
            {key: RotaryEmbedding(head_dim, max_position, params) for key, params in sorted(tables.items())}
        )
        # EAGLE-3's features, as LlamaModel keeps them.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids) * self.normalizer  # [T, hidden]
        # [T, head_dim] cos and sin per table, looked up once for every layer.
        rope = {key: table(positions) for key, table in self.rotary_emb.items()}
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for idx, (layer, rope_key) in enumerate(zip(self.layers, self.rope_keys, strict=True)):
            if idx in self.aux_hidden_state_layers:  # NOTE: a new tensor, as in LlamaModel
                aux[idx] = x if residual is None else x + residual
            x, residual = layer(x, *rope[rope_key], attn_metadata, residual)
        if self.aux_hidden_state_layers:
            self.aux_hidden_states = torch.cat([aux[idx] for idx in self.aux_hidden_state_layers], dim=-1)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's weight names, loading, tying and interface; Gemma's modules."""

    gemma_flags: ClassVar[GemmaFlags] = GemmaFlags()

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        # NOTE: not LlamaForCausalLM.__init__, which would build Llama's modules.
        ModelForCausalLM.__init__(self)
        self.config = hf_config
        self.model = Gemma2Model(hf_config, self.gemma_flags, attn_backend)  # type: ignore[assignment]
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_head = LogitsHead(hf_config.vocab_size, getattr(hf_config, "final_logit_softcapping", None))
        self.to(dtype)

    def get_attention_layers(self) -> list[Attention]:
        return [cast(Gemma2DecoderLayer, layer).self_attn.attn for layer in self.model.layers]
