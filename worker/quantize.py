"""Applying the configured quantization method to a loaded model (plugin kind
``quantization_method``; the interface is quantization/base.py)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.linear import LinearBase
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.platforms.interface import dtype_name

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.manager import PluginManager
    from pagedllm.quantization.base import QuantizationMethod


def load_quantization_method(
    name: str, plugin_manager: PluginManager, platform: Platform, dtype: torch.dtype
) -> type[QuantizationMethod]:
    """The registered method `name`, after its metadata says it runs here
    (UnknownComponentError lists the registered names)."""
    registration = plugin_manager.quantization_methods.get(name)
    info = registration.info
    problems = []
    if info.device_types is not None and platform.device_type not in info.device_types:
        problems.append(f"runs on {', '.join(info.device_types)}, not {platform.device_type}")
    if info.dtypes is not None and dtype_name(dtype) not in info.dtypes:
        problems.append(f"computes in {', '.join(info.dtypes)}, not {dtype_name(dtype)}")
    problems += [f"needs the package {package!r}" for package in info.requires
                 if importlib.util.find_spec(package) is None]
    if problems:
        raise ConfigError("model.quantization", name, f"a method that runs here ({name} {'; '.join(problems)})")
    return plugin_manager.quantization_methods.load(name)


class ConvertedLayers(NamedTuple):
    linear: int
    moe: int


def quantize_model(model: nn.Module, method: QuantizationMethod) -> ConvertedLayers:
    """Hand `method` every linear layer but the LM head (its weight may be the
    tied embedding's) and those whose weight is read raw (`skip_quantization`),
    and every MoE layer; how many of each it converted."""
    linear = moe = 0
    for prefix, module in model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(module, ParallelLMHead) and not module.skip_quantization:
            linear += bool(method.quantize_linear(module, prefix))
        elif isinstance(module, FusedMoE):
            moe += bool(method.quantize_moe(module, prefix))
    return ConvertedLayers(linear, moe)


__all__ = ["ConvertedLayers", "load_quantization_method", "quantize_model"]
