"""Tensor parallelism for the Transformers fallback, from transformers' TP plan.

A transformers model class that supports tensor parallelism declares a plan:
module name patterns (``model.layers.*.self_attn.q_proj``) -> a style. The
fallback applies the plan's common styles with pagedllm's own parallel
layers (model_registry/layers/), whose weight loaders narrow each checkpoint
tensor to the rank's slice and whose collectives are the platform's:

- ``colwise`` -> ColumnParallelLinear (the rank's output features: whole
  heads, as transformers' attention infers the head count from the shape),
- ``rowwise`` -> RowParallelLinear (the rank's input features, all-reduced),
- ``embedding_rowwise`` -> VocabParallelEmbedding,
- ``colwise_gather_output`` on the LM head -> ParallelLMHead (its logits are
  gathered by LogitsHead).

Any other style (packed, expert or sequence parallel ones), a model without
a plan, or KV heads that do not split evenly is a ConfigError on
``parallel.tensor_parallel_size`` before any rank starts (`check_tp_plan`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.model_registry.layers.tp_heads import TP_SIZE_FIELD
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED_STYLES = frozenset({"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"})


class FallbackColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear over transformers' [B, S, I] activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(0, -2)).unflatten(0, x.shape[:-1])


class FallbackRowParallelLinear(RowParallelLinear):
    """RowParallelLinear over transformers' [B, S, I / tp] activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(0, -2)).unflatten(0, x.shape[:-1])


def tp_plan_of(model_cls: type[PreTrainedModel], config: Any) -> dict[str, str]:
    """The model class's plan (its own entries and its base model's,
    prefixed) without building the model: what the engine checks. (A built
    model's `tp_plan` may add the input embeddings, `embedding_rowwise`.)"""
    plan = dict(getattr(model_cls, "_tp_plan", None) or {})
    prefix = model_cls.base_model_prefix
    for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        plan.setdefault(f"{prefix}.{pattern}" if prefix else pattern, style)
    return plan


def check_tp_plan(model_cls: type[PreTrainedModel], config: Any, architecture: str, tp_size: int) -> None:
    """A ConfigError naming -tp and the model when the fallback cannot split it."""
    plan = tp_plan_of(model_cls, config)
    if not plan:
        raise ConfigError(TP_SIZE_FIELD, tp_size, f"1: {architecture} runs on the Transformers fallback, and "
                          "transformers declares no tensor-parallel plan for it")
    unsupported = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if unsupported:
        raise ConfigError(TP_SIZE_FIELD, tp_size, f"1: {architecture}'s transformers TP plan uses "
                          f"{', '.join(unsupported)}, which the Transformers fallback does not apply")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ConfigError(TP_SIZE_FIELD, tp_size, f"a divisor of {architecture}'s attention heads ({num_heads}) "
                          f"and key/value heads ({num_kv_heads}) on the Transformers fallback")


def apply_tp_plan(hf_model: PreTrainedModel, config: Any, *, strict: bool = True) -> None:
    """Replace every module the plan names by this rank's parallel layer.
    `strict` False (one rank): replace what can be, leave the rest as it is
    (the layers still gain the platform's GEMMs); True: the rest is a ConfigError."""
    plan = getattr(hf_model, "tp_plan", None) or tp_plan_of(type(hf_model), config)  # as the instance assembled it
    patterns = [(re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$"), style) for name, style in plan.items()]
    tied = hf_model.get_output_embeddings() is not None and (
        hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
    )
    for name, module in list(hf_model.named_modules()):
        style = next((style for pattern, style in patterns if pattern.match(name)), None)
        if style is None:
            continue
        layer = _parallel_layer(module, style)
        if layer is None and strict:
            raise ConfigError(TP_SIZE_FIELD, get_tp_group().world_size, f"1: the TP plan's {style!r} for {name} "
                              f"({type(module).__name__}) is not applied by the Transformers fallback")
        if layer is not None:
            parent_name, _, child_name = name.rpartition(".")
            setattr(hf_model.get_submodule(parent_name), child_name, layer)
    if tied:
        output_embeddings = hf_model.get_output_embeddings()
        output_embeddings.weight = hf_model.get_input_embeddings().weight


def _parallel_layer(module: nn.Module, style: str) -> nn.Module | None:
    """This rank's layer for `module` under `style` (None: not one the fallback builds)."""
    weight = cast(torch.Tensor, module.weight)
    layer: nn.Module
    with torch.device(weight.device):
        if style == "embedding_rowwise" and type(module) is nn.Embedding:
            layer = VocabParallelEmbedding(module.num_embeddings, module.embedding_dim)
        elif style == "colwise_gather_output" and type(module) is nn.Linear and module.bias is None:
            layer = ParallelLMHead(module.out_features, module.in_features)
        elif style == "colwise" and type(module) is nn.Linear:
            layer = FallbackColumnParallelLinear(module.in_features, module.out_features, bias=module.bias is not None)
        elif style == "rowwise" and type(module) is nn.Linear:
            layer = FallbackRowParallelLinear(module.in_features, module.out_features, bias=module.bias is not None)
        else:
            return None
    return layer.to(weight.dtype)


def check_fallback_tensor_parallel(hf_config: Any, architecture: str, tp_size: int) -> None:
    """`check_tp_plan` from the checkpoint's config (the engine's check, before any rank starts)."""
    from pagedllm.model_registry.transformers_fallback.config import causal_lm_class, transformers_config

    model_cls = causal_lm_class(architecture)
    if model_cls is not None:  # (None: refused when the model is built)
        check_tp_plan(model_cls, transformers_config(hf_config), architecture, tp_size)
