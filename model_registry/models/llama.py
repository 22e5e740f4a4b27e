"""Llama (Touvron et al., 2023); also serves Mistral.

Pre-norm decoder: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)) with
SwiGLU; rotary positions; grouped-query attention over the paged KV cache.
Qwen2 and Qwen3 reuse these modules and flip the flags in `LlamaFlags`;
the mixture-of-experts families (Qwen2/3-MoE, Mixtral) swap the MLP.

Tensor parallel (Megatron-LM): each rank holds num_heads / tp query heads and
their KV heads (qkv_proj column-parallel, o_proj row-parallel), a 1/tp slice
of the MLP (gate_up column-, down row-parallel) and 1/tp of the vocabulary;
rotary and the q/k norms are per head, so they apply per rank unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.model_registry.layers.activation import SiluAndMul
from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_registry.layers.logits_head import LogitsHead
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.rotary import ApplyRotaryEmb, RotaryEmbedding, get_rope_parameters
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_registry.loader import default_weight_loader

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class LlamaFlags:
    """What Llama-family architectures differ in. None = read from the config."""

    qkv_bias: bool | None = None  # None: config.attention_bias
    o_proj_bias: bool | None = None  # None: config.attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE


def _layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:  # Qwen2/3: only layers marked "sliding_attention"
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window  # Mistral: every layer


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        flags: LlamaFlags,
        layer_idx: int,
        attn_backend: type[AttentionBackend],
        scale: float | None = None,  # None: head_dim ** -0.5
    ):
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden_size // total_num_heads
        attention_bias = getattr(hf_config, "attention_bias", False)
        qkv_bias = attention_bias if flags.qkv_bias is None else flags.qkv_bias
        o_proj_bias = attention_bias if flags.o_proj_bias is None else flags.o_proj_bias

        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, qkv_bias)
        # This rank's heads and their q / k / v widths.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_num_heads * self.head_dim, hidden_size, bias=o_proj_bias)
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=hf_config.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.rotary = ApplyRotaryEmb()
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            self.num_kv_heads,
            attn_backend,
            sliding_window=_layer_sliding_window(hf_config, layer_idx),
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        else:
            # q and k side by side in qkv: one rotary pass over both heads' rows.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
            q, k = self.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, attn_metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: Any, intermediate_size: int | None = None, reduce_results: bool = True):
        """`intermediate_size`: None is the config's (a MoE's shared expert
        has its own); `reduce_results=False` leaves this rank's partial sum."""
        super().__init__()
        bias = getattr(hf_config, "mlp_bias", False)
        if intermediate_size is None:
            intermediate_size = hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hf_config.hidden_size, bias=bias,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, flags: LlamaFlags, layer_idx: int, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.self_attn = LlamaAttention(hf_config, flags, layer_idx, attn_backend)
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
        """(h, residual): the layer's output is h + residual, left as two
        tensors (vLLM's layout) so that the next norm adds them in its own
        pass where a platform kernel fuses the two. `residual` None: x is the
        first layer's input."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, attn_metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    # A family whose block differs (Granite's scaled residuals, OLMo 2's
    # post-norms) names its own; it returns (h, residual) like Llama's, or
    # (x, None) when it adds its own residual.
    decoder_layer_cls: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    def __init__(self, hf_config: Any, flags: LlamaFlags, attn_backend: type[AttentionBackend]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(hf_config, flags, i, attn_backend) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        head_dim = cast(LlamaDecoderLayer, self.layers[0]).self_attn.head_dim if self.layers else 1
        # One cos/sin table for all layers: a forward looks its positions up once.
        self.rotary_emb = RotaryEmbedding(head_dim, hf_config.max_position_embeddings, get_rope_parameters(hf_config))
        # EAGLE-3's features: the residual stream entering these layers,
        # concatenated in this order into `aux_hidden_states` [T, n * hidden]
        # by every forward (empty: nothing kept, no extra copies).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_input_ids(input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions)  # [T, head_dim] each, shared by every layer
        residual = None
        aux_layers = self.aux_hidden_state_layers
        aux: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(self.layers):
            if idx in aux_layers:  # NOTE: a new tensor: a fused norm may update residual in place
                aux[idx] = x if residual is None else x + residual
            x, residual = layer(x, cos, sin, attn_metadata, residual)
        if aux_layers:
            self.aux_hidden_states = torch.cat([aux[idx] for idx in aux_layers], dim=-1)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)


class LlamaForCausalLM(ModelForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags()
    model_cls: ClassVar[type[LlamaModel]] = LlamaModel
    supports_tensor_parallel: ClassVar[bool] = True
    # checkpoint module name -> (our stacked module, shard index)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = hf_config
        self.model = self.model_cls(hf_config, self.flags, attn_backend)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logits_head = LogitsHead(hf_config.vocab_size)
        self.to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_head(self.lm_head, hidden_states).float()

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.model.aux_hidden_state_layers = tuple(layers)

    def get_aux_hidden_states(self) -> torch.Tensor | None:
        return self.model.aux_hidden_states

    def get_attention_layers(self) -> list[Attention]:
        return [cast(LlamaDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint entries that are neither loaded nor unexpected."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        # Tied: lm_head is embed_tokens; a saved copy of it is redundant.
        return self.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.is_ignored_weight(name):
                continue
            param_name, shard_id = self.checkpoint_to_param_name(name)
            param = params[param_name]
            if shard_id is None:
                # Sharded layers narrow the full tensor to this rank's slice.
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            loaded.add(param_name)
        return loaded

    @classmethod
    def checkpoint_to_param_name(cls, name: str) -> tuple[str, int | None]:
        return packed_param_name(name, cls.packed_modules_mapping)


def packed_param_name(name: str, packed_modules_mapping: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """'model.layers.0.self_attn.k_proj.weight' -> ('model.layers.0.self_attn.qkv_proj.weight', 1)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed_modules_mapping:
            packed_name, shard_id = packed_modules_mapping[part]
            return ".".join(parts[:i] + [packed_name] + parts[i + 1 :]), shard_id
    return name, None


