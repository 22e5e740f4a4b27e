"""Preparing a loaded model's layer ops for this rank (model_registry/layers/ops.py).

One op registry per model preparation: the platform's kernels, then the
quantization method's GEMM, each layer bound once before any forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.model_registry.layers.ops import OpRegistry, bind_layer_ops

if TYPE_CHECKING:
    from collections import Counter

    from torch import nn

    from pagedllm.platforms.interface import Platform
    from pagedllm.quantization.base import QuantizationMethod


def build_op_registry(platform: Platform, quantization: QuantizationMethod | None = None) -> OpRegistry:
    registry = OpRegistry()
    platform.register_layer_ops(registry.register)
    if quantization is not None:
        quantization.register_layer_ops(registry.register)
    return registry


def prepare_layer_ops(
    model: nn.Module, platform: Platform, quantization: QuantizationMethod | None = None
) -> Counter[str]:
    """Bind every op layer of `model`; how many layers each implementation took."""
    return bind_layer_ops(model, build_op_registry(platform, quantization))
