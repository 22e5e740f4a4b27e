"""The `compressed-tensors` quantization method: serves checkpoints that
llm-compressor writes (config.json ``quant_method: compressed-tensors``).

`from_checkpoint_config` reads the schemes (scheme.py); `create_weights`
gives each targeted linear layer the checkpoint's tensors (weights.py);
`quantize_linear` turns them into kernel storage:

- W8A16 (int8 per channel, group or tensor) and W4A16 (pack-quantized int4)
  -> the grouped layout (quantization/grouped_weight.py) on the grouped
  kernel (platforms/cpu/grouped_linear.py); a zero point becomes the
  layout's offset (-zero * scale).
- W8A8-INT8, FP8 W8A8 and FP8 weight-only -> `ScaledWeight` on
  scaled_linear.py's GEMMs.

Per-tensor weight scales stay one per stacked checkpoint module (q, k, v)
and become per-channel scales, so each shard keeps its own; the static
input scale of a stacked layer is the largest of its modules' (they read
the same x; vLLM does the same). With a ``kv_cache_scheme`` the attention
layers load the checkpoint's per-tensor ``k_scale`` / ``v_scale`` and hand
them to their backend: an fp8 KV cache stores K / k_scale, V / v_scale; a
cache in the compute dtype ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.platforms.cpu.grouped_linear import register_grouped_linear
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.compressed_tensors.scaled_linear import ScaledWeight, scaled_linear
from pagedllm.quantization.compressed_tensors.scheme import (
    FP8_W8A16,
    W4A16,
    W8A16,
    CompressedTensorsConfig,
    LayerScheme,
)
from pagedllm.quantization.compressed_tensors.weights import (
    check_packed_shape,
    create_weights,
    per_channel,
    pop_tensor,
)
from pagedllm.quantization.grouped_weight import GroupedWeight

PRIORITY = 100  # above any platform's float kernels: they cannot read these weights
KV_SCALES = ("k_scale", "v_scale")


class CompressedTensorsMethod(QuantizationMethod):
    def __init__(self, config: CompressedTensorsConfig | None = None) -> None:
        self.config = config  # None: built without a checkpoint; converts nothing
        self.schemes: dict[str, LayerScheme] = {}  # prefix -> scheme, of the layers it created

    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, Any]) -> QuantizationMethod:
        return cls(CompressedTensorsConfig(quant_config))

    def create_weights(self, layer: nn.Linear, prefix: str) -> bool:
        scheme = None if self.config is None else self.config.scheme_for(
            prefix, self.checkpoint_modules(prefix), type(layer).__name__)
        if scheme is None:
            return False
        create_weights(layer, scheme)
        self.schemes[prefix] = scheme
        return True

    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        scheme = self.schemes.get(prefix)
        if scheme is None:
            return False
        if scheme.kind in (W8A16, W4A16):
            grouped = grouped_weight(layer, scheme)
            layer.weight = nn.Parameter(grouped.codes, requires_grad=False)
            setattr(layer, "ct_grouped_weight", grouped)  # noqa: B010 (not an nn attribute)
        else:
            scaled = scaled_weight(layer, scheme)
            layer.weight = nn.Parameter(scaled.codes, requires_grad=False)
            setattr(layer, "ct_scaled_weight", scaled)  # noqa: B010 (not an nn attribute)
        return True

    def create_attention_weights(self, layer: nn.Module, prefix: str) -> bool:
        kv_cache = None if self.config is None else self.config.kv_cache
        if kv_cache is None or kv_cache.dynamic is True or not hasattr(layer, "impl"):
            return False
        for name in KV_SCALES:
            param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
            param.weight_loader = _load_scalar  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        return True

    def quantize_attention(self, layer: nn.Module, prefix: str) -> bool:
        if not all(isinstance(getattr(layer, name, None), torch.Tensor) for name in KV_SCALES):
            return False
        impl = getattr(layer, "impl")  # noqa: B009 (model_registry's Attention, duck-typed)
        impl.k_scale, impl.v_scale = (float(getattr(layer, name)) for name in KV_SCALES)
        return True

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        register_grouped_linear(register, "compressed-tensors", _grouped_weight_of, priority=PRIORITY)
        register("linear", "compressed-tensors-scaled", _build_scaled, priority=PRIORITY,
                 supports=lambda layer: getattr(layer, "ct_scaled_weight", None) is not None)


def _load_scalar(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tensor.numel() != 1:
        raise ValueError(f"shape mismatch: a KV-cache scale has one element, checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        param.copy_(tensor.reshape(()))


def grouped_weight(layer: nn.Module, scheme: LayerScheme) -> GroupedWeight:
    """The layer's loaded W8A16 / W4A16 tensors in the grouped layout."""
    args = scheme.weights
    check_packed_shape(layer)
    pop_tensor(layer, "weight_shape")
    packed = pop_tensor(layer, "weight_packed")
    codes = pop_tensor(layer, "weight") if packed is None else packed
    assert codes is not None  # create_weights made one of them
    if scheme.kind == W8A16 and packed is not None:  # each byte is code + 128
        codes = (codes.to(torch.int16) - 128).to(torch.int8)
    num_out = codes.shape[0]
    scales = _scales_2d(layer, pop_tensor(layer, "weight_scale"), num_out)
    zero_point = pop_tensor(layer, "weight_zero_point")
    offsets = None if zero_point is None else -_scales_2d(layer, zero_point, num_out) * scales
    if scheme.kind == W4A16:  # codes 0..15 stand for -8..7
        offsets = -8.0 * scales
    num_in = codes.shape[1] * (2 if scheme.kind == W4A16 else 1)
    group_size = args.group_size if args.strategy == "group" and args.group_size else num_in
    return GroupedWeight(8 if scheme.kind == W8A16 else 4, group_size, codes.contiguous(), scales.contiguous(),
                         None if offsets is None else offsets.contiguous()).validate()


def _scales_2d(layer: nn.Module, values: torch.Tensor | None, num_out: int) -> torch.Tensor:
    """float32 [N, K // g] from a group [N, K // g], channel [N] or per-shard tensor value."""
    assert values is not None
    if values.dim() == 2:
        return values.float()
    if values.shape[0] == num_out:
        return values.float()[:, None]
    return per_channel(layer, values)[:, None]


def scaled_weight(layer: nn.Module, scheme: LayerScheme) -> ScaledWeight:
    codes = pop_tensor(layer, "weight")
    scale = pop_tensor(layer, "weight_scale")
    assert codes is not None and scale is not None  # create_weights made them
    scales = scale.float() if scale.shape[0] == codes.shape[0] and scheme.weights.strategy == "channel" else (
        per_channel(layer, scale))
    input_scale = pop_tensor(layer, "input_scale")
    return ScaledWeight(codes.contiguous(), scales.contiguous(), None if input_scale is None else input_scale.max(),
                        quantize_input=scheme.kind != FP8_W8A16)


def _grouped_weight_of(layer: nn.Module) -> GroupedWeight | None:
    return getattr(layer, "ct_grouped_weight", None)


def _build_scaled(layer: nn.Module) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    weight: ScaledWeight = getattr(layer, "ct_scaled_weight")  # noqa: B009

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return scaled_linear(x, weight, bias)

    return apply_linear


__all__ = ["CompressedTensorsMethod", "grouped_weight", "scaled_weight"]
