"""The checkpoint's tensors of one compressed-tensors linear layer, as the
layer's parameters (before loading), and what they become (after it).

Stored per module of the checkpoint (q_proj, k_proj, ... each on its own):

    weight             int8 or float8_e4m3fn [N, K]    (int-/float-/naive-quantized)
    weight_packed      int32 [N, K * bits / 32]        (pack-quantized: 32 / bits codes
                       a word, the lowest bits first, each code + 2^(bits-1))
    weight_shape       int [2]                         (pack-quantized)
    weight_scale       [N, 1] channel, [N, K // g] group, [1] or [] tensor
    weight_zero_point  like weight_scale (asymmetric int8 weights)
    input_scale        [1] or []                       (static activations)

Every tensor is handed to the layer's own ``weight_loader`` in the float
weight's [out, in] orientation, so the layer slices it for the rank and
the stacked shard: a channel scale as [N], the packed words viewed as their
bytes (uint8 [N, K * bits / 8]: with 8 bits each byte is one code + 128,
with 4 bits two codes, input k even in the low nibble, which is the grouped
layout's W4 order). Per-tensor values (a scale, an input scale) are kept
one per stacked shard and expanded to per-channel scales after loading, so
q, k and v keep their own scales exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.quantization.base import UnsupportedCheckpointError
from pagedllm.quantization.compressed_tensors.scheme import FP8_W8A8, FP8_W8A16, LayerScheme

Loader = Callable[..., None]


def shard_rows(layer: Any) -> list[int]:
    """This rank's output rows of each stacked checkpoint module, in order."""
    if hasattr(layer, "shard_sizes"):  # MergedColumnParallelLinear (gate, up)
        return list(layer.shard_sizes)
    if hasattr(layer, "q_size") and hasattr(layer, "kv_size"):  # QKVParallelLinear
        return [int(layer.q_size), int(layer.kv_size), int(layer.kv_size)]
    return [int(layer.out_features)]


def create_weights(layer: Any, scheme: LayerScheme) -> None:
    """Replace `layer.weight` with the parameters the checkpoint stores for `scheme`."""
    loader: Loader = layer.weight_loader
    num_out, num_in = layer.weight.shape
    num_shards = len(shard_rows(layer))
    del layer.weight
    args = scheme.weights
    if scheme.format == "pack-quantized":
        _add(layer, "weight_packed", torch.empty(num_out, num_in * args.num_bits // 8, dtype=torch.uint8),
             _as_bytes(loader))
        _add(layer, "weight_shape", torch.zeros(num_shards, 2, dtype=torch.int64), _per_shard)
    else:
        dtype = torch.float8_e4m3fn if scheme.kind in (FP8_W8A16, FP8_W8A8) else torch.int8
        _add(layer, "weight", torch.empty(num_out, num_in, dtype=dtype), loader)
    names = ["weight_scale"] + ([] if args.symmetric else ["weight_zero_point"])
    for name in names:
        dtype = torch.float32 if name == "weight_scale" else torch.int8
        if args.strategy == "group":
            if args.group_size is None or num_in % args.group_size:
                raise UnsupportedCheckpointError(f"group_size={args.group_size} does not divide this rank's "
                                                 f"{num_in} inputs")
            _add(layer, name, torch.zeros(num_out, num_in // args.group_size, dtype=dtype), loader)
        elif args.strategy == "channel":
            _add(layer, name, torch.zeros(num_out, dtype=dtype), _flattened(loader))
        else:
            _add(layer, name, torch.zeros(num_shards, dtype=dtype), _per_shard)
    if scheme.static_input_scale:
        _add(layer, "input_scale", torch.zeros(num_shards, dtype=torch.float32), _per_shard)


def _add(layer: nn.Module, name: str, tensor: torch.Tensor, loader: Loader) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    layer.register_parameter(name, param)


def _call(loader: Loader, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any) -> None:
    if shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)


def _flattened(loader: Loader) -> Loader:
    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if tensor.dim() != 2 or tensor.shape[1] != 1:
            raise ValueError(f"shape mismatch: a per-channel scale is [N, 1], checkpoint has {tuple(tensor.shape)}")
        _call(loader, param, tensor.reshape(-1), shard_id)

    return load


def _as_bytes(loader: Loader) -> Loader:
    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        if tensor.dtype != torch.int32:
            raise ValueError(f"weight_packed must be int32, checkpoint has {tensor.dtype}")
        packed = tensor.contiguous().view(torch.uint8)  # little-endian words: the codes in order
        _call(loader, param, packed, shard_id)

    return load


def _per_shard(param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
    """One value (or a weight_shape) per stacked shard: every rank holds them whole."""
    row = 0 if shard_id is None else int(shard_id)
    if param.dim() == 1 and tensor.numel() != 1:
        raise ValueError(f"shape mismatch: a per-tensor value has one element, checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        param[row] = tensor.reshape(param[row].shape)


def per_channel(layer: nn.Module, values: torch.Tensor) -> torch.Tensor:
    """One value per stacked shard -> one per output row [N] (float32)."""
    rows = torch.tensor(shard_rows(layer), device=values.device)
    return values.float().repeat_interleave(rows)


def pop_tensor(layer: nn.Module, name: str) -> torch.Tensor | None:
    """The loaded parameter `name` (removed from the layer), or None."""
    tensor = getattr(layer, name, None)
    if tensor is None:
        return None
    delattr(layer, name)
    return tensor.detach()


def check_packed_shape(layer: Any) -> None:
    """pack-quantized: every shard's weight_shape [N, K] names this layer's
    K inputs (a row-parallel rank holds K / tp of them)."""
    shapes = getattr(layer, "weight_shape", None)
    if shapes is None:
        return
    inputs = {int(k) for k in shapes[:, 1]}
    allowed = {int(layer.in_features), int(layer.in_features) * int(getattr(layer, "tp_size", 1))}
    if len(inputs) != 1 or not inputs <= allowed:
        raise UnsupportedCheckpointError(f"weight_shape inputs {sorted(inputs)} do not match the layer's "
                                         f"{layer.in_features} (per rank)")


__all__ = ["check_packed_shape", "create_weights", "per_channel", "pop_tensor", "shard_rows"]
