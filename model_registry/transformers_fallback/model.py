"""TransformersForCausalLM: transformers' own modeling code over the paged KV cache.

The model is built from its config by transformers (the architecture's
``...ForCausalLM`` class, remote code off) with attention implementation
`ATTN_IMPLEMENTATION` (attention.py). Its parameters keep the checkpoint's
names (the transformers model's children are this module's children), so
pagedllm's strict loader reads the safetensors into them as into any model.

A step's flattened batch [T] runs as transformers' batch [1, T] with
``position_ids`` = the tokens' positions: rotary (or whatever positional
scheme the architecture has) is computed by transformers from them, and
transformers keeps no cache and builds no mask (``use_cache=False``; the
paged attention needs neither). The final norm's output [T, hidden] is the
hidden state; `compute_logits` applies the output embeddings and the
final-logit transforms transformers' CausalLM forward applies.

The linear layers, embeddings and LM head that transformers' TP plan for
the architecture names are pagedllm's parallel layers (tensor_parallel.py):
each rank's slice at -tp > 1, and at one rank the platform's GEMMs. Limits: quantization and EAGLE's auxiliary hidden
states are native-model features; architectures whose attention modules do not
take transformers' attention interface (``_supports_attention_backend``) or
that pass arguments the paged backends cannot honour are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.layers.logits_head import LogitsHead
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.model_registry.loader import default_weight_loader
from pagedllm.model_registry.transformers_fallback.attention import (
    ATTN_IMPLEMENTATION,
    LayerAttentionFacts,
    UnsupportedAttentionError,
    register_paged_attention,
)
from pagedllm.model_registry.transformers_fallback.config import causal_lm_class, transformers_config
from pagedllm.model_registry.transformers_fallback.tensor_parallel import apply_tp_plan, check_tp_plan

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


class TransformersForCausalLM(ModelForCausalLM):
    """Any decoder transformers knows, run by transformers with paged attention."""

    # Where transformers declares a TP plan for the architecture (tensor_parallel.py).
    supports_tensor_parallel: ClassVar[bool] = True
    # Kept in __dict__, outside the module tree (their parameters are our children's).
    hf_model: PreTrainedModel
    base_model: nn.Module  # hf_model.base_model: embeddings, decoder layers, final norm
    output_embeddings: nn.Module  # the LM head

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        super().__init__()
        config = transformers_config(hf_config)
        architecture = str((getattr(config, "architectures", None) or ["?"])[0])
        hf_model = _build_transformers_model(config, architecture, dtype)
        tp_size = get_tp_group().world_size
        if tp_size > 1:
            check_tp_plan(type(hf_model), config, architecture, tp_size)
        # NOTE: at one rank too: pagedllm's linear layers take the platform's
        # GEMMs (the CPU's prepacked ones), which transformers' nn.Linear do not.
        apply_tp_plan(hf_model, config, strict=tp_size > 1)
        # NOTE: the transformers model's children are ours, so parameter names
        # are the checkpoint's; the model itself is kept outside the module tree.
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.__dict__["hf_model"] = hf_model
        self.__dict__["base_model"] = hf_model.base_model  # one of those children
        self.architecture = architecture
        facts = _probe_attention_layers(hf_model, architecture)
        self.attention_layers = nn.ModuleList(
            Attention(f.num_heads, f.head_size, f.scale, f.num_kv_heads, attn_backend,
                      sliding_window=f.sliding_window, logits_soft_cap=f.logits_soft_cap)
            for f in facts
        )
        output_embeddings = hf_model.get_output_embeddings()
        if output_embeddings is None:
            raise ConfigError("model.architecture", architecture, "a causal LM with output embeddings (an LM head)")
        self.__dict__["output_embeddings"] = output_embeddings  # one of those children
        self.tied_lm_head = output_embeddings.weight is hf_model.get_input_embeddings().weight
        self.logits_head = LogitsHead(config.get_text_config().vocab_size)  # gathers a ParallelLMHead's logits
        text_config = config.get_text_config()
        self.final_logit_softcapping: float | None = getattr(text_config, "final_logit_softcapping", None)
        self.logits_scaling: float | None = getattr(text_config, "logits_scaling", None)  # Granite: divides
        self.logit_scale: float | None = getattr(text_config, "logit_scale", None)  # Cohere: multiplies
        unexpected = getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
        self._ignored_patterns = [re.compile(pattern) for pattern in unexpected]
        self._weight_renamings, self._weight_converters = _weight_conversions(hf_model)
        self._param_names = {name: True for name, _ in self.named_parameters()}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden]
        out = self.base_model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            attn_metadata=attn_metadata,
            pagedllm_attention_layers=self.attention_layers,
        )
        return cast(torch.Tensor, out.last_hidden_state[0])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if isinstance(self.output_embeddings, ParallelLMHead):  # tensor parallel: this rank's vocabulary
            logits = self.logits_head(self.output_embeddings, hidden_states)
        else:
            logits = self.output_embeddings(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def get_attention_layers(self) -> list[Attention]:
        return [cast(Attention, layer) for layer in self.attention_layers]

    def is_ignored_weight(self, name: str) -> bool:
        """A saved copy of a tied LM head, a saved rotary table, and what the
        transformers class itself ignores in checkpoints."""
        if self.tied_lm_head and name == "lm_head.weight":
            return True
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return any(pattern.search(name) for pattern in self._ignored_patterns)

    def map_checkpoint_name(self, name: str) -> str:
        """transformers' renamings of older checkpoint names (GPT-NeoX's
        ``embed_out`` -> ``lm_head``; a base model's names without the
        prefix); a name that needs one of its tensor conversions (fusing,
        splitting) is a ValueError: the fallback copies tensors as they are."""
        from transformers.core_model_loading import rename_source_key

        renamed, converter = rename_source_key(
            name, self._weight_renamings, self._weight_converters,
            base_model_prefix=self.hf_model.base_model_prefix, meta_state_dict=self._param_names,
        )
        if converter is not None:
            raise ValueError(
                f"checkpoint weight {name} needs transformers' conversion {converter!r}, "
                "which the Transformers fallback does not apply"
            )
        return renamed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.is_ignored_weight(name):
                continue
            param = params[name]
            # A tensor-parallel layer's loader narrows the full tensor to this rank's slice.
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def _build_transformers_model(config: PretrainedConfig, architecture: str, dtype: torch.dtype) -> PreTrainedModel:
    model_cls = causal_lm_class(architecture)
    if model_cls is None:
        raise ConfigError(
            "model.architecture", architecture, "a decoder-only causal LM architecture transformers knows"
        )
    if not model_cls.is_backend_compatible():
        raise ConfigError(
            "model.architecture",
            architecture,
            "a transformers model class whose attention takes custom implementations "
            f"(_supports_attention_backend = True); {model_cls.__name__} does not declare it, "
            "so the Transformers fallback cannot run it",
        )
    register_paged_attention()
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = model_cls._from_config(config, dtype=dtype)
    return model.eval()


def _probe_attention_layers(hf_model: PreTrainedModel, architecture: str) -> list[LayerAttentionFacts]:
    """Run one token through the (not yet loaded) model, recording what each
    attention module passes: one entry per layer, in layer order."""
    probe: dict[int, LayerAttentionFacts] = {}
    device = next(hf_model.parameters()).device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            hf_model.base_model(input_ids=token, position_ids=token, use_cache=False, pagedllm_probe=probe)
    except UnsupportedAttentionError as err:
        raise ConfigError("model.architecture", architecture, f"an architecture the fallback can run: {err}") from err
    if not probe or sorted(probe) != list(range(len(probe))):
        raise ConfigError(
            "model.architecture",
            architecture,
            "a transformers model whose attention modules pass pagedllm's arguments through "
            f"(the probe saw layers {sorted(probe)})",
        )
    return [probe[idx] for idx in range(len(probe))]


def _weight_conversions(hf_model: PreTrainedModel) -> tuple[list[Any], list[Any]]:
    """transformers' checkpoint transforms for this model: (renamings, converters)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    return renamings, converters
