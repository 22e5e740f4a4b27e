"""gguf: llama.cpp's quantized linear weights, kept quantized.

Serves a GGUF file whose config (model_registry/gguf_checkpoint.py) names
the linear weights the loader yields quantized, ``quantization_config =
{"quant_method": "gguf", "tensor_types": {module: "Q8_0" | "Q6_K" | "Q4_K"}}``.
Each such layer gets, before loading, its storage in the grouped layout
(quantization/grouped_weight.py): ``qweight`` (the codes, a parameter) and
the buffers ``qscales`` and ``qoffsets``. The loader hands ``qweight`` each
shard's raw GGUF blocks; its loader converts them exactly
(quantization/gguf_convert.py) and passes codes, scales and offsets to the
layer's own ``weight_loader``, which slices them for the rank and the
stacked shard. The layer then runs on the grouped 8/4-bit kernels.

One layout per layer, which every shard's type represents exactly:

    Q8_0 -> W8, g=32;  Q6_K -> W8, g=16;  Q4_K -> W4, g=32 with offsets
    shards of different types (Q4_K_M's q/k Q4_K and v Q6_K) -> W8 with
        the smallest group and offsets when any shard has them: Q4_K codes
        0..15 fit int8, a g=32 scale repeats over two g=16 groups, a type
        without offsets gets zeros (code * scale + 0 is code * scale).

At tensor_parallel_size > 1 each rank's slice of a row-parallel layer's
inputs must be whole groups (a ConfigError otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.platforms.cpu.grouped_linear import register_grouped_linear
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.gguf_convert import GroupedTensor, convert_gguf_tensor
from pagedllm.quantization.grouped_weight import GroupedWeight, unpack_w4

GGUF_PRIORITY = 100  # above any platform's float GEMM: it cannot read codes
# Stacked layer -> the modules whose tensors it holds, in shard order (the
# GGUF-served model classes' packed_modules_mapping).


class GGUFLayout(NamedTuple):
    bits: int
    group_size: int
    offsets: bool


TYPE_LAYOUTS = {"Q8_0": GGUFLayout(8, 32, False), "Q6_K": GGUFLayout(8, 16, False), "Q4_K": GGUFLayout(4, 32, True)}


def unified_layout(tensor_types: Sequence[str]) -> GGUFLayout:
    """The one layout that holds every shard's type exactly."""
    layouts = {TYPE_LAYOUTS[tensor_type] for tensor_type in tensor_types}
    if len(layouts) == 1:
        return layouts.pop()
    return GGUFLayout(8, min(layout.group_size for layout in layouts), any(layout.offsets for layout in layouts))


def to_layout(grouped: GroupedTensor, layout: GGUFLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes, scales, offsets) of `grouped` in `layout` (a unified_layout of its type)."""
    codes = grouped.codes
    if grouped.bits == 4 and layout.bits == 8:
        codes = unpack_w4(codes).to(torch.int8)  # 0..15
    repeat = grouped.group_size // layout.group_size
    scales = grouped.scales.repeat_interleave(repeat, dim=1) if repeat > 1 else grouped.scales
    offsets = grouped.offsets
    if offsets is not None and repeat > 1:
        offsets = offsets.repeat_interleave(repeat, dim=1)
    if offsets is None and layout.offsets:
        offsets = torch.zeros_like(scales)
    return codes, scales, offsets


class GGUFMethod(QuantizationMethod):
    def __init__(self, tensor_types: dict[str, str] | None = None) -> None:
        self.tensor_types = dict(tensor_types or {})

    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, Any]) -> QuantizationMethod:
        tensor_types = dict(quant_config.get("tensor_types") or {})
        unknown = sorted({str(t) for t in tensor_types.values()} - set(TYPE_LAYOUTS))
        if unknown:
            raise ConfigError("quantization_config.tensor_types", unknown, f"GGUF types {', '.join(TYPE_LAYOUTS)}")
        return cls(tensor_types)

    def shard_names(self, prefix: str) -> list[str] | None:
        """The modules whose GGUF tensors the layer `prefix` holds, when all are kept quantized."""
        shards = self.checkpoint_modules(prefix)
        return shards if all(shard in self.tensor_types for shard in shards) else None

    def create_weights(self, layer: nn.Linear, prefix: str) -> bool:
        shards = self.shard_names(prefix)
        if shards is None:
            return False
        layout = unified_layout([self.tensor_types[shard] for shard in shards])
        num_out, num_in = layer.weight.shape
        check_whole_groups(layer, prefix, num_in, layout)
        code_dtype, code_cols = (torch.int8, num_in) if layout.bits == 8 else (torch.uint8, num_in // 2)
        layer_loader: Callable[..., None] = layer.weight_loader  # type: ignore[assignment]
        # NOTE: the float weight goes before loading (the memory is the point).
        del layer.weight
        qweight = nn.Parameter(torch.empty(num_out, code_cols, dtype=code_dtype), requires_grad=False)
        scales = torch.empty(num_out, num_in // layout.group_size, dtype=torch.float32)
        layer.qweight = qweight
        layer.register_buffer("qscales", scales)
        layer.register_buffer("qoffsets", torch.empty_like(scales) if layout.offsets else None)
        layer.gguf_layout = layout  # type: ignore[assignment]
        qweight.weight_loader = functools.partial(  # type: ignore[attr-defined]
            self.load_shard, layer, layer_loader, layout, [self.tensor_types[shard] for shard in shards])
        return True

    def load_shard(self, layer: nn.Module, layer_loader: Callable[..., None], layout: GGUFLayout,
                   shard_types: list[str], param: nn.Parameter, raw: torch.Tensor, shard_id: int | None = None) -> None:
        """One shard's raw GGUF blocks -> the layer's codes, scales and offsets."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType[shard_types[0 if shard_id is None else shard_id]]
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_out, row_bytes = raw.shape
        grouped = convert_gguf_tensor(raw.numpy(), tensor_type, [num_out, row_bytes // type_size * block_size])
        if grouped is None:  # NOTE: TYPE_LAYOUTS lists only types gguf_convert converts
            raise ValueError(f"gguf_convert does not convert {tensor_type.name}")
        shard = () if shard_id is None else (shard_id,)
        targets = (param, getattr(layer, "qscales"), getattr(layer, "qoffsets"))  # noqa: B009 (buffers)
        for target, tensor in zip(targets, to_layout(grouped, layout), strict=True):
            if tensor is not None:
                layer_loader(target, tensor, *shard)

    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        layout = getattr(layer, "gguf_layout", None)
        if not isinstance(layout, GGUFLayout):
            return False
        codes, scales, offsets = (getattr(layer, name) for name in ("qweight", "qscales", "qoffsets"))
        weight = GroupedWeight(layout.bits, layout.group_size, codes.data, scales, offsets)
        layer.gguf_weight = weight.validate(prefix)  # type: ignore[assignment]
        return True

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        register_grouped_linear(register, "gguf", gguf_weight_of, priority=GGUF_PRIORITY)


def gguf_weight_of(layer: nn.Module) -> GroupedWeight | None:
    weight = getattr(layer, "gguf_weight", None)
    return weight if isinstance(weight, GroupedWeight) else None


def check_whole_groups(layer: nn.Module, prefix: str, num_in: int, layout: GGUFLayout) -> None:
    """A rank's inputs must be whole groups: a group split across ranks has one scale for two slices."""
    if num_in % layout.group_size == 0:
        return
    tp_size = int(getattr(layer, "tp_size", 1))
    raise ConfigError("parallel.tensor_parallel_size", tp_size, (
        f"a size that leaves each rank whole GGUF groups of {layout.group_size} inputs in {prefix} "
        f"({num_in * tp_size} inputs, {num_in} per rank)"
    ))


__all__ = ["TYPE_LAYOUTS", "GGUFLayout", "GGUFMethod", "to_layout", "unified_layout"]
