"""Applying the configured quantization method to a loaded model (plugin kind
``quantization_method``; the interface is quantization/base.py)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.attention import Attention
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.linear import LinearBase
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead
from pagedllm.model_registry.loader import ModelLoadError, check_checkpoint_quantization, checkpoint_quant_method
from pagedllm.platforms.interface import dtype_name
from pagedllm.quantization.base import UnsupportedCheckpointError

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
    attention: int = 0  # attention layers given the checkpoint's KV-cache scales


class QuantizationPlan(NamedTuple):
    """Which method quantizes the model, and from what."""

    name: str | None  # the registered method; None: the model runs as loaded
    # The checkpoint format it reads (config.json quant_method); None: the
    # checkpoint is float (quantized at load by `name`, if any).
    checkpoint_format: str | None = None
    checkpoint_config: dict[str, Any] | None = None  # config.json's quantization_config

    def build(self, method_cls: type[QuantizationMethod], model_path: str = "") -> QuantizationMethod:
        """The method; a checkpoint it cannot read is the model's ModelLoadError."""
        if self.checkpoint_format is None:
            return method_cls()
        with checkpoint_errors(model_path):
            return method_cls.from_checkpoint_config(dict(self.checkpoint_config or {}))


@contextlib.contextmanager
def checkpoint_errors(model_path: str) -> Iterator[None]:
    """A method's UnsupportedCheckpointError as ModelLoadError naming the model."""
    try:
        yield
    except UnsupportedCheckpointError as err:
        raise ModelLoadError(model_path, detail=str(err)) from err


def plan_quantization(
    configured: str | None, hf_config: Any, model_cls: type, plugin_manager: PluginManager, model_path: str,
) -> QuantizationPlan:
    """The method for this checkpoint: a float checkpoint (or a format the
    model class reads itself, `checkpoint_quant_methods`) runs `configured`;
    a quantized one runs the method `configured` names if it reads the format,
    else the first registered method that does. ModelLoadError when none
    reads it; ConfigError when `configured` cannot apply to it."""
    fmt = checkpoint_quant_method(hf_config)
    readers = [registration.name for registration in plugin_manager.quantization_methods.registrations()
               if fmt is not None and fmt in registration.info.checkpoint_formats]
    if fmt is None or fmt in tuple(getattr(model_cls, "checkpoint_quant_methods", ())):
        if configured is not None and not plugin_manager.quantization_methods.get(configured).info.quantizes_float:
            raise ConfigError("model.quantization", configured, "a method that quantizes a float checkpoint at load "
                              f"({configured} only reads checkpoints quantized in its own format)")
        return QuantizationPlan(configured)
    if not readers:
        check_checkpoint_quantization(hf_config, model_cls, model_path)  # raises, naming the format
    if configured is not None and configured not in readers:
        raise ConfigError("model.quantization", configured,
                          f"a method that reads the checkpoint's {fmt!r} format ({', '.join(readers) or 'none'})")
    return QuantizationPlan(configured or readers[0], fmt, _as_dict(getattr(hf_config, "quantization_config", None)))


def _as_dict(quant_config: Any) -> dict[str, Any]:
    if quant_config is None or isinstance(quant_config, dict):
        return dict(quant_config or {})
    return dict(quant_config.to_dict())  # transformers' QuantizationConfigMixin


def create_checkpoint_weights(model: nn.Module, method: QuantizationMethod, model_path: str = "") -> ConvertedLayers:
    """Before loading a quantized checkpoint: the method replaces the storage of
    every layer `quantize_model` would hand it with the checkpoint's tensors,
    and gives attention layers what the checkpoint stores for their KV cache."""
    linear = moe = 0
    method.stacked_modules = stacked_modules(model)
    with checkpoint_errors(model_path):
        for prefix, module in _quantizable_layers(model):
            if isinstance(module, FusedMoE):
                moe += bool(method.create_moe_weights(module, prefix))
            else:
                linear += bool(method.create_weights(module, prefix))
        attention = sum(bool(method.create_attention_weights(module, prefix))
                        for prefix, module in _attention_layers(model))
    return ConvertedLayers(linear, moe, attention)


def stacked_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The model's packed_modules_mapping inverted: stacked layer -> its
    checkpoint modules in shard order."""
    packed: dict[str, tuple[str, int]] = getattr(model, "packed_modules_mapping", {})
    stacked: dict[str, list[tuple[int, str]]] = {}
    for source, (target, shard_id) in packed.items():
        stacked.setdefault(target, []).append((shard_id, source))
    return {target: tuple(source for _, source in sorted(sources)) for target, sources in stacked.items()}


def _attention_layers(model: nn.Module) -> Iterator[tuple[str, Attention]]:
    for prefix, module in model.named_modules():
        if isinstance(module, Attention):
            yield prefix, module


def _quantizable_layers(model: nn.Module) -> Iterator[tuple[str, LinearBase | FusedMoE]]:
    """Every linear layer but the LM head (its weight may be the tied
    embedding's) and those whose weight is read raw (`skip_quantization`),
    and every MoE layer."""
    for prefix, module in model.named_modules():
        is_linear = isinstance(module, LinearBase) and not isinstance(module, ParallelLMHead)
        if (is_linear and not module.skip_quantization) or isinstance(module, FusedMoE):
            yield prefix, module


def quantize_model(model: nn.Module, method: QuantizationMethod) -> ConvertedLayers:
    """Hand `method` every layer `_quantizable_layers` yields; how many of each
    kind it converted."""
    linear = moe = 0
    for prefix, module in _quantizable_layers(model):
        if isinstance(module, FusedMoE):
            moe += bool(method.quantize_moe(module, prefix))
        else:
            linear += bool(method.quantize_linear(module, prefix))
    attention = sum(bool(method.quantize_attention(module, prefix)) for prefix, module in _attention_layers(model))
    return ConvertedLayers(linear, moe, attention)


__all__ = [
    "ConvertedLayers", "QuantizationPlan", "checkpoint_errors", "create_checkpoint_weights", "load_quantization_method",
    "plan_quantization", "quantize_model",
]
