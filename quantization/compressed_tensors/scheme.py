"""Reading a compressed-tensors `quantization_config` (config.json).

    {"quant_method": "compressed-tensors", "format": "int-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "int", "symmetric": true,
                     "strategy": "channel", "dynamic": false, "group_size": null},
         "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                               "dynamic": true, ...} | null}},
     "ignore": ["lm_head"], "kv_cache_scheme": {... "type": "float", "num_bits": 8} | null,
     "sparsity_config": null}

A layer's scheme is the first group whose `targets` match it (a class name,
"Linear" for every linear layer, "re:<regex>" matched from the start of the
module name, or the module name itself) and that `ignore` does not name;
a stacked layer (qkv_proj, gate_up_proj) is matched by its checkpoint
modules (q_proj, k_proj, v_proj), which must share one scheme.

The schemes this reader runs (`SCHEME_KINDS`), in vLLM's names:
W8A16 (int8 weights per channel, group or tensor), W4A16 (pack-quantized
int4, per group or channel), W8A8-INT8 (int8 weights per channel or tensor,
int8 activations per token dynamic or per tensor static), FP8 weight-only
and FP8 W8A8 (float8_e4m3fn weights per channel or tensor, fp8
activations per token dynamic or per tensor static). Anything else (2:4
sparsity, W4A8, NVFP4/MXFP4, block-wise FP8, asymmetric activations, an
unknown format) is refused naming the scheme.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.quantization.base import UnsupportedCheckpointError

FORMAT = "compressed-tensors"
STORED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
# A stacked layer's checkpoint modules (vLLM's default packed mapping).
W8A16, W4A16, W8A8_INT8, FP8_W8A16, FP8_W8A8 = "W8A16", "W4A16", "W8A8-INT8", "FP8-W8A16", "FP8-W8A8"
SCHEME_KINDS = (W8A16, W4A16, W8A8_INT8, FP8_W8A16, FP8_W8A8)


@dataclass(frozen=True)
class QuantArgs:
    """One QuantizationArgs of compressed-tensors (weights, activations or KV cache)."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group" | "token" | "block" | ...
    dynamic: bool | str
    group_size: int | None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> QuantArgs:
        group_size = raw.get("group_size")
        strategy = raw.get("strategy") or ("group" if group_size else "tensor")
        return cls(int(raw.get("num_bits", 8)), str(raw.get("type", "int")), bool(raw.get("symmetric", True)),
                   str(strategy), raw.get("dynamic", False), None if group_size is None else int(group_size))

    def describe(self) -> str:
        group = f" group_size={self.group_size}" if self.strategy == "group" else ""
        dynamic = " dynamic" if self.dynamic is True else ""
        symmetric = "" if self.symmetric else " asymmetric"
        return f"{self.type}{self.num_bits} {self.strategy}{group}{dynamic}{symmetric}"


@dataclass(frozen=True)
class LayerScheme:
    kind: str  # one of SCHEME_KINDS
    format: str  # how the weight is stored (STORED_FORMATS)
    weights: QuantArgs
    activations: QuantArgs | None  # None: weight-only

    @property
    def static_input_scale(self) -> bool:
        return self.activations is not None and self.activations.dynamic is not True


def classify(weights: QuantArgs, activations: QuantArgs | None, stored_format: str) -> str:
    """The scheme's kind, or UnsupportedCheckpointError naming it."""
    name = f"weights {weights.describe()}" + (f", input_activations {activations.describe()}" if activations else "")
    if stored_format not in STORED_FORMATS:
        raise UnsupportedCheckpointError(f"compressed-tensors format {stored_format!r} ({name}) is not supported; "
                                         f"supported: {', '.join(STORED_FORMATS)}")
    kind = _kind(weights, activations, stored_format)
    if kind is None:
        raise UnsupportedCheckpointError(f"compressed-tensors scheme {name} (format {stored_format}) is not "
                                         f"supported; supported: {', '.join(SCHEME_KINDS)}")
    return kind


def _kind(weights: QuantArgs, activations: QuantArgs | None, stored_format: str) -> str | None:
    packed = stored_format == "pack-quantized"
    if weights.dynamic is not False or weights.num_bits not in (4, 8) or (packed and not weights.symmetric):
        return None
    if weights.type == "int" and activations is None and weights.num_bits == 4:
        return W4A16 if packed and weights.strategy in ("group", "channel") else None
    if weights.num_bits != 8 or weights.type not in ("int", "float") or (weights.type == "float" and packed):
        return None
    if activations is None:
        if weights.type == "int":
            return W8A16 if weights.strategy in ("tensor", "channel", "group") else None
        return FP8_W8A16 if weights.type == "float" and weights.strategy in ("tensor", "channel") else None
    fits = (weights.symmetric and weights.strategy in ("tensor", "channel") and activations.num_bits == 8
            and activations.symmetric and activations.type == weights.type
            and (activations.strategy, activations.dynamic) in (("token", True), ("tensor", False)))
    if not fits:
        return None
    return W8A8_INT8 if weights.type == "int" else FP8_W8A8


@dataclass(frozen=True)
class ConfigGroup:
    targets: tuple[str, ...]
    scheme: LayerScheme | None  # None: a group that quantizes no weights (left as loaded)


class CompressedTensorsConfig:
    """The parsed quantization_config; UnsupportedCheckpointError for what it cannot run."""

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        sparsity = quant_config.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise UnsupportedCheckpointError(f"compressed-tensors sparsity {sparsity.get('format')!r} "
                                             "(e.g. 2:4 sparse weights) is not supported")
        default_format = str(quant_config.get("format") or "naive-quantized")
        raw_groups = quant_config.get("config_groups") or {}
        if not raw_groups:
            raise UnsupportedCheckpointError("compressed-tensors quantization_config has no config_groups")
        self.groups = [_parse_group(raw, default_format) for raw in raw_groups.values()]
        self.ignore = tuple(str(target) for target in quant_config.get("ignore") or ())
        raw_kv = quant_config.get("kv_cache_scheme")
        self.kv_cache = None if raw_kv is None else QuantArgs.parse(raw_kv)
        if self.kv_cache is not None and (self.kv_cache.type, self.kv_cache.num_bits, self.kv_cache.strategy) != (
                "float", 8, "tensor"):
            raise UnsupportedCheckpointError(f"compressed-tensors kv_cache_scheme {self.kv_cache.describe()} is not "
                                             "supported; supported: float8 per tensor (k_scale / v_scale)")

    def scheme_for(self, prefix: str, names: list[str], class_name: str) -> LayerScheme | None:
        """The scheme of the linear layer `prefix`, which holds the checkpoint
        modules `names` (None: it stays float); UnsupportedCheckpointError
        when those stacked modules disagree."""
        schemes = {name: self._scheme_of(name, class_name) for name in names}
        if len(set(schemes.values())) > 1:
            found = ", ".join(f"{name}: {scheme.kind if scheme else 'float'}" for name, scheme in schemes.items())
            raise UnsupportedCheckpointError(f"the modules stacked into {prefix} are quantized differently ({found})")
        return schemes[names[0]]

    def _scheme_of(self, name: str, class_name: str) -> LayerScheme | None:
        if any(_matches(target, name, class_name) for target in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(target, name, class_name) for target in group.targets):
                return group.scheme
        return None


def _parse_group(raw: Mapping[str, Any], default_format: str) -> ConfigGroup:
    targets = tuple(str(target) for target in raw.get("targets") or ())
    raw_weights, raw_inputs = raw.get("weights"), raw.get("input_activations")
    if raw.get("output_activations"):
        raise UnsupportedCheckpointError("compressed-tensors output_activations quantization is not supported")
    if raw_weights is None:
        if raw_inputs is not None:
            raise UnsupportedCheckpointError("compressed-tensors activation-only quantization is not supported")
        return ConfigGroup(targets, None)
    weights = QuantArgs.parse(raw_weights)
    activations = None if raw_inputs is None else QuantArgs.parse(raw_inputs)
    stored_format = str(raw.get("format") or default_format)
    if stored_format == "mixed-precision":
        stored_format = "naive-quantized"
    return ConfigGroup(targets, LayerScheme(classify(weights, activations, stored_format), stored_format, weights,
                                            activations))


def _matches(target: str, name: str, class_name: str) -> bool:
    """compressed-tensors' target rule: "re:<regex>" from the start of the
    module name, else the module name itself or its class ("Linear": any)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (name, class_name) or (target == "Linear" and class_name.endswith("Linear"))


__all__ = ["SCHEME_KINDS", "CompressedTensorsConfig", "LayerScheme", "QuantArgs", "classify"]
