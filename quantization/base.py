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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn



class QuantizationMethod(ABC):
    """Built as ``MethodCls()``; `quantize_linear` runs once per layer at load."""

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


__all__ = ["QuantizationMethod"]
