"""The model interface: what the engine asks of a registered architecture.

A model is registered for a Hugging Face architecture name
(``register("LlamaForCausalLM", "pkg.mod:Cls")``) and built as
``Cls(hf_config, attn_backend, dtype=dtype)`` inside a ``torch.device``
context, then filled with ``load_weights``. Its attention layers
(``model_registry/layers/attention.py``) hold the paged KV cache.

Plugin API 1.0 models were duck-typed: an ``nn.Module`` with the four
methods below. They still are models: ``issubclass`` accepts any
``nn.Module`` subclass that defines them (as ``collections.abc`` does for
its one-method interfaces), so the registry's interface check passes for
them. New models subclass :class:`ModelForCausalLM` and get the defaults
of the optional parts.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from torch import nn

from pagedllm.attention_backends.base import AttentionRequirements
from pagedllm.model_registry.source import ModelSource

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionMetadata
    from pagedllm.model_registry.layers.attention import Attention

_REQUIRED = ("forward", "compute_logits", "load_weights", "get_attention_layers")


def config_attention_requirements(hf_config: Any) -> AttentionRequirements:
    """What a Hugging Face config's usual keys ask of the attention backend:
    `head_dim` (else hidden / heads), `sliding_window` (unless
    `use_sliding_window` is false or no `layer_types` entry is a sliding
    layer) and `attn_logit_softcapping`. No sinks: a model with them says so."""
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    return AttentionRequirements((head_size,), window, getattr(hf_config, "attn_logit_softcapping", None))


def attention_requirements_of(model_cls: type, hf_config: Any) -> AttentionRequirements:
    """The model class's `attention_requirements(hf_config)`; a duck-typed
    (plugin API 1.0) model without it gets what its config's usual keys say."""
    read = getattr(model_cls, "attention_requirements", None)
    return cast(AttentionRequirements, read(hf_config)) if callable(read) else config_attention_requirements(hf_config)


class ModelForCausalLM(nn.Module, metaclass=ABCMeta):
    """A decoder-only language model over the paged KV cache (vLLM's
    ``VllmModelForTextGeneration``)."""

    # Optional weight-name mapping, read by the strict loader
    # (model_registry/loader.py): checkpoint module name -> (the module that
    # stacks it here, shard index), e.g. {"q_proj": ("qkv_proj", 0)}.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    # Whether the model builds its layers tensor-parallel (plugin API 1.3):
    # each rank holding its slice of them (model_registry/layers/linear.py),
    # so it may run with parallel.tensor_parallel_size > 1. A model that
    # does not say so (1.0 duck-typed models included) runs at size 1 only.
    supports_tensor_parallel: ClassVar[bool] = False

    @classmethod
    def attention_requirements(cls, hf_config: Any) -> AttentionRequirements:
        """What this model's attention layers will ask of the backend (head
        sizes, windows, soft cap, sinks), from its config alone: the backend
        is chosen before the model is built. The default reads the usual
        config keys (`config_attention_requirements`); a model with more
        (sinks, per-layer head sizes) overrides it."""
        return config_attention_requirements(hf_config)

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] (the flattened batch) -> hidden states [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> float32 logits [N, vocab]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint (name, tensor) pairs in; return the parameter names filled."""

    @abstractmethod
    def get_attention_layers(self) -> list[Attention]:
        """Every attention layer, in layer order: one KV cache tensor each."""

    def is_ignored_weight(self, name: str) -> bool:
        """Checkpoint entries that are neither loaded nor unexpected (e.g. a
        saved rotary table, or the copy of a tied lm_head)."""
        return False

    def map_checkpoint_name(self, name: str) -> str:
        """The parameter name a checkpoint entry fills (the strict loader asks
        before matching it): itself, unless the model's checkpoints use older
        names (the Transformers fallback applies transformers' renamings)."""
        return name

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Keep the hidden states entering these layers at every forward
        (EAGLE-3's features); a model that cannot says so."""
        raise NotImplementedError(f"{type(self).__name__} keeps no auxiliary hidden states")

    def get_aux_hidden_states(self) -> torch.Tensor | None:
        """The last forward's kept states, [T, len(layers) * hidden] (None: none kept)."""
        return None

    @classmethod
    def __subclasshook__(cls, candidate: type) -> bool:
        if cls is ModelForCausalLM and issubclass(candidate, nn.Module) and all(
            any(name in vars(k) for k in candidate.__mro__ if k is not nn.Module) for name in _REQUIRED
        ):
            return True  # a duck-typed (plugin API 1.0) model
        return cast(bool, NotImplemented)  # ABCMeta's usual check decides


# ModelSource: re-exported, as in plugin API 1.2
__all__ = ["ModelForCausalLM", "ModelSource", "attention_requirements_of", "config_attention_requirements"]
