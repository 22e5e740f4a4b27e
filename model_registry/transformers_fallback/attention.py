"""pagedllm's paged attention as a transformers attention implementation.

transformers 5 calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
from every attention module of a model that declares
``_supports_attention_backend``, as
``fn(module, query [B, H, S, D], key [B, Hkv, S, D], value, attention_mask,
scaling=..., dropout=..., **kwargs)`` -> (output [B, S, H, D], weights), with
the keyword arguments of the model's forward passed down to it. The
fallback's forward runs the flattened batch as B = 1, S = T and passes the
step's `attn_metadata` and the per-layer paged `Attention` layers as two of
those keywords: no global state, and a layer finds its own cache by
``module.layer_idx``.

Because this name has no mask function in transformers' mask interface,
transformers builds no causal mask (``create_causal_mask`` returns None):
causality, sliding windows and the request boundaries inside the flattened
batch are the paged backend's, from the metadata.

A probe forward (`probe_attention_layers`) records what each layer passes
(heads, head size, scaling, sliding window, soft-cap) so that the paged
layers are built with exactly transformers' values; anything the paged
backends cannot honour (attention sinks, a non-causal layer, a mask the
model builds itself) is refused there, before any weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionMetadata
    from pagedllm.model_registry.layers.attention import Attention

# The name registered in transformers' AttentionInterface.
ATTN_IMPLEMENTATION = "pagedllm_paged"
# Keyword arguments that reach the attention function and carry nothing the
# paged backends must honour (the positions are applied by the model's rotary
# before the call; no cache is used).
_IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})
# Keyword arguments the paged layer is built from (checked at every call in the probe).
_LAYER_KWARGS = frozenset({"sliding_window", "softcap"})


@dataclass(frozen=True)
class LayerAttentionFacts:
    """What one transformers attention module passes to the attention
    function: the paged layer is built from it."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None


class UnsupportedAttentionError(ValueError):
    """A transformers attention module asks for something the paged backends
    do not do; the fallback turns it into a ConfigError naming the architecture."""


def register_paged_attention() -> None:
    """Register `paged_attention_forward` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    probe: dict[int, LayerAttentionFacts] | None = kwargs.get("pagedllm_probe")
    if probe is not None:
        facts = _layer_facts(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        probe[facts.layer_idx] = facts
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    layers: list[Attention] | None = kwargs.get("pagedllm_attention_layers")
    attn_metadata: AttentionMetadata | None = kwargs.get("attn_metadata")
    if layers is None or attn_metadata is None:
        raise RuntimeError(
            f"{type(module).__name__} was called without pagedllm's attention arguments: "
            "only TransformersForCausalLM.forward may run this attention implementation"
        )
    layer = layers[cast(int, module.layer_idx)]
    num_tokens = query.shape[2]
    # [1, H, T, D] -> [T, H * D]: the flattened batch the paged layer takes.
    out = layer(
        query[0].transpose(0, 1).reshape(num_tokens, -1),
        key[0].transpose(0, 1).reshape(num_tokens, -1),
        value[0].transpose(0, 1).reshape(num_tokens, -1),
        attn_metadata,
    )
    return out.view(1, num_tokens, layer.num_heads, layer.head_size), None


def _layer_facts(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> LayerAttentionFacts:
    name = type(module).__name__
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise UnsupportedAttentionError(f"{name} has no layer_idx, so its paged KV cache cannot be found")
    if attention_mask is not None:
        raise UnsupportedAttentionError(f"{name} builds its own attention mask; the paged backends apply causality")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise UnsupportedAttentionError(f"{name} is not causal (an encoder); the fallback serves decoders only")
    if dropout:
        raise UnsupportedAttentionError(f"{name} applies attention dropout {dropout} at inference")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise UnsupportedAttentionError(f"{name} has different query, key and value head sizes")
    unknown = sorted(
        arg for arg, val in kwargs.items()
        if val is not None and arg not in _IGNORED_KWARGS | _LAYER_KWARGS and not arg.startswith("pagedllm_")
    )
    if unknown:  # e.g. GPT-OSS's attention sinks (s_aux)
        raise UnsupportedAttentionError(f"{name} passes {', '.join(unknown)}, which the paged backends do not take")
    head_size = query.shape[-1]
    return LayerAttentionFacts(
        layer_idx=layer_idx,
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        head_size=head_size,
        scale=float(scaling) if scaling is not None else head_size**-0.5,
        sliding_window=kwargs.get("sliding_window"),
        logits_soft_cap=kwargs.get("softcap"),
    )
