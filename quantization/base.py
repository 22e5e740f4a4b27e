"""The quantization-method interface (plugin kind ``quantization_method``):
how a model's linear layers store and multiply their weights.

A method is built once per rank, after the model's weights are loaded (in
the checkpoint's precision, each rank's slice). The worker hands it every
linear layer of the model but the LM head, with the layer's dotted name
(``model.layers.0.self_attn.qkv_proj``; never a layer that declares
``skip_quantization``: a weight read raw, an MoE router), and the method converts the layer
in place: it replaces the layer's storage (``layer.weight``, extra buffers
such as scales) and its GEMM, ``layer.apply_linear(x, bias)``. The layer's
tensor-parallel collectives stay outside the GEMM, so a method never sees
them: at tensor_parallel_size > 1 it quantizes each rank's slice as a whole
matrix. A layer the method leaves alone (``quantize_linear`` returns False)
runs as loaded.

The GEMM over the converted storage is the method's implementation of the
"linear" layer op (model_registry/layers/ops.py), offered in
`register_layer_ops` with a `supports(layer)` that recognises the layers it
converted; the layer asks the op registry once, after every layer is
converted. (A method written for plugin API 1.x that sets
``layer.apply_linear`` itself still works: that per-instance GEMM runs.)

Mixture-of-experts layers (``FusedMoE``, model_registry/layers/fused_moe.py)
are offered separately, to ``quantize_moe(layer, prefix)`` (plugin API 1.12;
default: left as loaded, so a method written before it still runs an MoE
model, its experts in float). A method that converts them replaces the
layer's ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] (this rank's
slice of every expert) with its storage, and offers the computation over
it as the "fused_moe" layer op in `register_layer_ops`, with a `supports`
that recognises the layers it converted. The router, the biases and the
all-reduce after the layer stay the layer's.

Quantized checkpoints (plugin API 1.14): a method that reads a checkpoint
format (GPTQ, AWQ, compressed-tensors ...) lists the
``quantization_config.quant_method`` values it reads in its registration's
``checkpoint_formats``; such a checkpoint is served by the first registered
method that reads it (or the one `model.quantization` names), built by
`from_checkpoint_config` with config.json's ``quantization_config``. Before
any weight is loaded, `create_weights(layer, prefix)` replaces the layer's
float ``weight`` with the parameters the checkpoint stores for it
(``qweight``, ``scales`` ...), each with a ``weight_loader(param, tensor[,
shard_id])``: the loader feeds them by name exactly as it feeds float
weights (``q_proj.qweight`` into the stacked ``qkv_proj.qweight``), so a
method whose loader turns each checkpoint tensor into one with the float
weight's [out, in] orientation can hand it on to the layer's own
``weight_loader``, which slices it for the rank and the stacked shard. After
loading, `quantize_linear` runs as for a float checkpoint: there it turns
the loaded tensors into its kernel's storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import PagedLLMError

if TYPE_CHECKING:
    from torch import nn


class UnsupportedCheckpointError(PagedLLMError, ValueError):
    """A quantized checkpoint a method cannot read (a scheme, a format, a
    setting), raised from `from_checkpoint_config` or `create_weights`; the
    worker reports it as the model's ModelLoadError, with the model's path."""


class QuantizationMethod(ABC):
    """Built as ``MethodCls()`` (a float checkpoint quantized at load) or
    ``MethodCls.from_checkpoint_config(quantization_config)`` (a checkpoint
    in a format it reads); `quantize_linear` runs once per layer at load."""

    # The checkpoint modules stacked into the model's layers, by the layer's
    # local name ({"qkv_proj": ("q_proj", "k_proj", "v_proj"), ...}, in shard
    # order): the model's `packed_modules_mapping`, which the worker sets
    # before `create_weights` (plugin API 1.14).
    stacked_modules: Mapping[str, tuple[str, ...]] = MappingProxyType({})

    def checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint modules whose tensors the layer `prefix` holds:
        ``...q_proj``, ``...k_proj``, ``...v_proj`` for a stacked
        ``...qkv_proj``; ``[prefix]`` for a layer that stacks nothing."""
        head, _, local = prefix.rpartition(".")
        return [f"{head}.{part}" if head else part for part in self.stacked_modules.get(local, (local,))]

    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, Any]) -> QuantizationMethod:
        """The method for a checkpoint whose config.json `quantization_config`
        is `quant_config` (a plain dict); UnsupportedCheckpointError for
        settings it does not read. Default: ``cls()``, the settings ignored."""
        return cls()

    def create_weights(self, layer: nn.Linear, prefix: str) -> bool:
        """Before loading: replace `layer.weight` with the parameters the
        checkpoint stores for it, each with a ``weight_loader``; True when it
        did. Default: False, the layer loads a float weight (a layer the
        checkpoint leaves unquantized, such as GPTQ's ignored modules)."""
        return False

    def create_moe_weights(self, layer: nn.Module, prefix: str) -> bool:
        """`create_weights` for a ``FusedMoE`` layer's experts. Default: False,
        the experts load as float (a method whose checkpoints quantize them
        and that cannot read them raises UnsupportedCheckpointError naming the format)."""
        return False

    def create_attention_weights(self, layer: nn.Module, prefix: str) -> bool:
        """Before loading: give an attention layer (model_registry's
        ``Attention``) the parameters the checkpoint stores for its KV cache,
        such as per-tensor ``k_scale`` / ``v_scale`` (an fp8 KV cache's
        scales), each with a ``weight_loader(param, tensor)``. The strict
        loader also feeds them the names checkpoints use beside the attention
        module (``self_attn.k_scale``, ``self_attn.k_proj.output_scale``).
        Default: False, nothing stored (plugin API 1.14)."""
        return False

    def quantize_attention(self, layer: nn.Module, prefix: str) -> bool:
        """After loading: hand what `create_attention_weights` loaded to the
        layer's backend impl (``layer.impl.k_scale`` / ``v_scale``, floats);
        True when it did. Default: False."""
        return False

    @abstractmethod
    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        """Convert `layer` (an ``nn.Linear`` with ``apply_linear(x, bias)``,
        its float weight loaded) in place; True when it was converted."""

    def quantize_moe(self, layer: nn.Module, prefix: str) -> bool:
        """Convert the expert weights of `layer` (a ``FusedMoE``, its float
        ``w13_weight`` and ``w2_weight`` loaded) in place; True when it was
        converted. Default: False, the experts stay as loaded."""
        return False

    def register_layer_ops(self, register: Callable[..., None]) -> None:  # noqa: B027 (optional)
        """Offer the GEMM of the converted layers:
        ``register("linear", name, build, priority=..., supports=...)``, and
        for converted MoE layers their experts' computation:
        ``register("fused_moe", name, build, priority=..., supports=...)``.
        Default: nothing (the layers keep F.linear, or a GEMM the method set)."""


__all__ = ["QuantizationMethod", "UnsupportedCheckpointError"]
