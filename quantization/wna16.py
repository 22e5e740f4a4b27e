"""What GPTQ and AWQ checkpoints share: N-bit integer weights packed into
int32, per-group fp16 scales and packed zero points, 16-bit activations
(vLLM's "wNa16").

Both store, per linear layer, `qweight` (codes), `qzeros` (one zero point
per group and output channel), `scales` (one per group and output channel)
and, for GPTQ, `g_idx` (each input's group); they differ in which axis the
codes are packed along and in what order (gptq.py, awq.py). A method here
reads them in three steps:

1. `create_weights`: before loading, the layer's float weight is replaced
   by `qweight` uint8 [N, K] (one code per byte), `qzeros` uint8 [N, G],
   `scales` float32 [N, G] (and `g_idx` int32 [K]): the float weight's
   [out, in] orientation, so each checkpoint tensor, unpacked by the
   format's converter, goes through the layer's own `weight_loader`, which
   takes this rank's rows (column-parallel, stacked q/k/v or gate/up) or
   columns (row-parallel) as for a float weight;
2. `quantize_linear`: after loading, the codes become
   quantization/grouped_weight.py's layout, w = code * scale + offset with
   offset = -zero * scale; an act-order checkpoint (g_idx not k // g) has
   its inputs sorted by group once here, and the layer's GEMM permutes x's
   columns the same way;
3. `register_layer_ops`: the GEMM, the CUDA platform's Triton W4 kernel on a
   CUDA device (platforms/cuda_grouped_linear.py) and the CPU's grouped
   kernel everywhere else (platforms/cpu/grouped_linear.py, which computes
   the layout's reference_linear off its grid and off the CPU).

Per-channel checkpoints (group_size -1) are one group per rank's slice of K.
A row-parallel layer splits K across ranks: each rank's slice must hold
whole groups, and act-order is refused there (a rank's inputs would belong
to groups of every rank); both are ModelLoadErrors naming the layer.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pagedllm.model_registry.layers.linear import RowParallelLinear
from pagedllm.model_registry.loader import ModelLoadError
from pagedllm.platforms.cpu import grouped_linear
from pagedllm.platforms.cpu.kernel_build import prebuild_in_background
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.grouped_weight import GroupedWeight, pack_w4

PACKED_BITS = 32  # codes are packed into int32
PER_CHANNEL = -1  # group_size of one scale per output channel
GROUPED_PRIORITY = 100  # above the platforms' float GEMMs, which cannot read codes
TRITON_PRIORITY = 110
_REQUIRED = object()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """int32 with 32 // bits codes per element along `dim`, the first code in
    the lowest bits -> uint8 codes, `dim` that many times longer. `order[j]`:
    the slot holding the j-th code of each int32 (AWQ interleaves them)."""
    factor = PACKED_BITS // bits
    slots = torch.arange(factor, dtype=torch.int32, device=packed.device)
    if order is not None:
        slots = slots[list(order)]
    moved = packed.to(torch.int32).movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> (slots * bits)) & ((1 << bits) - 1)  # [..., P, factor]
    return codes.flatten(-2).to(torch.uint8).movedim(-1, dim)


def checkpoint_error(fmt: str, detail: str) -> ModelLoadError:
    return ModelLoadError(f"the {fmt} checkpoint", detail=detail)


def unsupported(fmt: str, key: str, value: object, supported: str) -> ModelLoadError:
    return checkpoint_error(fmt, f"config.json quantization_config.{key}={value!r} is not supported by "
                                 f"pagedllm's {fmt} reader; supported: {supported}")


def config_value(quant_config: dict[str, Any], keys: Sequence[str], fmt: str, default: Any = _REQUIRED) -> Any:
    """The first of `keys` present in `quant_config`; ModelLoadError when none is and there is no default."""
    for key in keys:
        if key in quant_config:
            return quant_config[key]
    if default is _REQUIRED:
        raise checkpoint_error(fmt, f"config.json quantization_config has no {' or '.join(keys)}")
    return default


def check_group_size(fmt: str, key: str, group_size: object) -> int:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (
            group_size != PER_CHANNEL and group_size <= 0):
        raise unsupported(fmt, key, group_size, "a positive number of inputs per group, or -1 (per channel)")
    return group_size


@dataclass(frozen=True)
class WNA16Config:
    fmt: str  # "gptq" or "awq": names the format in errors and op names
    bits: int  # 4 or 8
    group_size: int  # inputs per scale; -1: one per output channel
    desc_act: bool = False  # act-order: g_idx is a grouping of permuted inputs
    zero_shift: int = 0  # added to each stored zero point (GPTQ v1 stores zero - 1)
    has_g_idx: bool = False  # the checkpoint stores g_idx
    skip_modules: tuple[str, ...] = ()  # layers it leaves in float (AWQ's modules_to_not_convert)


class WNA16Method(QuantizationMethod):
    """A checkpoint of packed integer weights; the format's converters are
    `unpack_qweight` and `unpack_qzeros` (checkpoint tensor -> [N, K] / [N, G])."""

    def __init__(self, config: WNA16Config | None = None) -> None:
        # No config: built for a float checkpoint (load_format dummy); it converts nothing.
        self.config = config

    @abstractmethod
    def unpack_qweight(self, qweight: torch.Tensor) -> torch.Tensor:
        """The format's packed qweight as one code per element, [K, N]."""

    @abstractmethod
    def unpack_qzeros(self, qzeros: torch.Tensor) -> torch.Tensor:
        """The format's packed qzeros as one zero point per element, [K / g, N]."""

    def create_weights(self, layer: nn.Linear, prefix: str) -> bool:
        config = self.config
        if config is None or any(name in prefix for name in config.skip_modules):
            return False
        group_size, repeat = self.rank_grouping(layer, prefix)
        num_out, num_in = layer.out_features, layer.in_features
        num_groups = num_in // group_size
        layer_loader = cast("Callable[..., None]", layer.weight_loader)
        del layer.weight
        add_parameter(layer, "qweight", torch.empty(num_out, num_in, dtype=torch.uint8),
                      converting(layer_loader, lambda t: self.unpack_qweight(t).t()))
        add_parameter(layer, "qzeros", torch.empty(num_out, num_groups, dtype=torch.uint8),
                      converting(layer_loader, lambda t: self.unpack_qzeros(t).t().repeat(1, repeat)))
        add_parameter(layer, "scales", torch.empty(num_out, num_groups, dtype=torch.float32),
                      converting(layer_loader, lambda t: t.t().float().repeat(1, repeat)))
        if config.has_g_idx:
            add_parameter(layer, "g_idx", torch.empty(num_in, dtype=torch.int32), g_idx_loader(layer, prefix, config))
        return True

    def rank_grouping(self, layer: nn.Linear, prefix: str) -> tuple[int, int]:
        """(this rank's inputs per group, how many times each stored group
        column repeats): per channel, one group per rank's slice of K."""
        config = self.config
        assert config is not None
        num_in = layer.in_features
        num_ranks = layer.tp_size if isinstance(layer, RowParallelLinear) else 1
        row_split = num_ranks > 1
        if config.group_size == PER_CHANNEL:
            return num_in, num_ranks
        where = f"{prefix} (K={num_in} inputs on each of {num_ranks} tensor-parallel ranks)" if row_split else (
            f"{prefix} (K={num_in} inputs)")
        if num_in % config.group_size:
            raise checkpoint_error(config.fmt, f"group_size={config.group_size} does not divide the inputs of {where}"
                                   "; a group may not be split across tensor-parallel ranks")
        if row_split and config.desc_act:
            raise checkpoint_error(config.fmt, f"desc_act=True (act-order) under tensor parallelism is not supported "
                                   f"for the row-parallel {where}; supported: tensor_parallel_size=1, or "
                                   "a checkpoint with desc_act=False")
        return config.group_size, 1

    def create_moe_weights(self, layer: nn.Module, prefix: str) -> bool:
        fmt = "GPTQ/AWQ" if self.config is None else self.config.fmt.upper()
        raise ModelLoadError(f"the {fmt} checkpoint", detail=(
            f"{prefix}: mixture-of-experts layers in {fmt} checkpoints are not supported yet "
            "(GPTQ/AWQ experts); supported: dense models"))

    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        config = self.config
        if config is None or not isinstance(getattr(layer, "qweight", None), torch.Tensor):
            return False
        codes, zeros, scales = (cast("torch.Tensor", getattr(layer, name)).data
                                for name in ("qweight", "qzeros", "scales"))
        group_size = int(codes.shape[1] // scales.shape[1])
        perm = input_order(layer, prefix, config, group_size)
        if perm is not None:
            codes = codes[:, perm]
        weight = to_grouped_weight(config.bits, group_size, codes, scales, zeros.float() + config.zero_shift)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        # NOTE: the codes take the float weight's name, so the layer's parameter list keeps `weight`.
        layer.weight = nn.Parameter(weight.codes, requires_grad=False)
        layer.register_buffer("weight_scale", weight.scales)
        layer.register_buffer("weight_offset", weight.offsets)
        layer.register_buffer("input_perm", perm)
        layer.grouped_weight = weight  # type: ignore[assignment]
        return True

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        fmt = "wna16" if self.config is None else self.config.fmt
        register("linear", f"{fmt}_triton", build_triton_gemm, priority=TRITON_PRIORITY, supports=runs_on_triton)
        register("linear", f"{fmt}_grouped", build_grouped_gemm, priority=GROUPED_PRIORITY, supports=holds_codes)


def add_parameter(layer: nn.Module, name: str, tensor: torch.Tensor, loader: Callable[..., None]) -> None:
    param = nn.Parameter(tensor, requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    layer.register_parameter(name, param)


def converting(layer_loader: Callable[..., None], convert: Callable[[torch.Tensor], torch.Tensor]
               ) -> Callable[..., None]:
    """A weight_loader that turns the checkpoint tensor into the float
    weight's [out, in] orientation, then lets the layer take its slice."""

    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, *shard_id: int) -> None:
        layer_loader(param, convert(loaded), *shard_id)

    return weight_loader


def g_idx_loader(layer: nn.Linear, prefix: str, config: WNA16Config) -> Callable[..., None]:
    """g_idx [K] is the layer's inputs': a row-parallel rank takes its slice
    (numbered from its first group); stacked layers (q/k/v, gate/up) read
    one input, so each stacked shard must store the same g_idx."""
    row_split = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
    rank, num_ranks = (layer.tp_rank, layer.tp_size) if isinstance(layer, RowParallelLinear) and row_split else (0, 1)

    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, *shard_id: int) -> None:
        num_in = int(param.shape[0])
        expected = num_in * num_ranks
        if list(loaded.shape) != [expected]:
            raise ValueError(f"shape mismatch: model expects ({expected},), checkpoint has {tuple(loaded.shape)}")
        local = loaded.narrow(0, rank * num_in, num_in).to(torch.int32)
        if config.group_size != PER_CHANNEL:
            local = local - rank * (num_in // config.group_size)
        if getattr(param, "loaded_once", False) and not torch.equal(param.data, local.to(param.device)):
            raise checkpoint_error(config.fmt, f"{prefix}: the stacked projections store different g_idx "
                                   "(act-order permutations); supported: one g_idx for the layers that read one input")
        with torch.no_grad():
            param.copy_(local)
        param.loaded_once = True  # type: ignore[attr-defined]

    return weight_loader


def input_order(layer: nn.Module, prefix: str, config: WNA16Config, group_size: int) -> torch.Tensor | None:
    """The permutation that sorts the inputs by g_idx (act-order); None when
    g_idx is k // group_size (or absent, or per channel)."""
    g_idx = getattr(layer, "g_idx", None)
    if g_idx is None or config.group_size == PER_CHANNEL:
        return None
    grouping = torch.arange(g_idx.numel(), device=g_idx.device, dtype=torch.int32) // group_size
    if torch.equal(g_idx.data, grouping):
        return None
    perm = torch.argsort(g_idx.data, stable=True)
    if not torch.equal(g_idx.data[perm], grouping):
        raise checkpoint_error(config.fmt, f"{prefix}: g_idx does not put group_size={group_size} inputs in each "
                               "group; supported: an act-order permutation of whole groups")
    return perm


def to_grouped_weight(bits: int, group_size: int, codes: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor) -> GroupedWeight:
    """w = (q - zero) * scale as the grouped layout: W4 codes q, offset
    -zero * scale; W8 codes q - 128 (int8), offset -(zero - 128) * scale."""
    if bits == 4:
        return GroupedWeight(4, group_size, pack_w4(codes.contiguous()), scales.contiguous(),
                             (-zeros * scales).contiguous()).validate()
    signed = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    return GroupedWeight(8, group_size, signed, scales.contiguous(), (-(zeros - 128) * scales).contiguous()).validate()


def grouped_weight_of(layer: nn.Module) -> GroupedWeight | None:
    weight = getattr(layer, "grouped_weight", None)
    return weight if isinstance(weight, GroupedWeight) else None


def holds_codes(layer: nn.Module) -> bool:
    return grouped_weight_of(layer) is not None


def runs_on_triton(layer: nn.Module) -> bool:
    weight = grouped_weight_of(layer)
    return weight is not None and weight.bits == 4 and weight.codes.is_cuda


def with_input_perm(layer: nn.Module, gemm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    perm = getattr(layer, "input_perm", None)
    if perm is None:
        return gemm

    def apply_linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemm(x.index_select(-1, perm), bias)

    return apply_linear


def build_grouped_gemm(layer: nn.Module) -> Callable[..., torch.Tensor]:
    """The CPU kernel (the layout's reference off its grid and off the CPU)."""
    prebuild_in_background(grouped_linear.load)  # the compile overlaps the rest of the model's preparation
    weight = grouped_weight_of(layer)
    assert weight is not None  # supports() said so
    return with_input_perm(layer, grouped_linear.GroupedLinearKernel(weight))


def build_triton_gemm(layer: nn.Module) -> Callable[..., torch.Tensor]:
    from pagedllm.platforms import cuda_grouped_linear  # imports triton: only once a layer takes it

    weight = grouped_weight_of(layer)
    assert weight is not None  # supports() said so
    return with_input_perm(layer, cuda_grouped_linear.build(weight))


__all__ = [
    "PER_CHANNEL", "WNA16Config", "WNA16Method", "check_group_size", "config_value", "to_grouped_weight",
    "unpack_int32", "unsupported",
]
