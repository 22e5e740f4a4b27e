"""The quantization-method suite: built with no arguments, the method
converts the model's linear layers in place (column- and row-parallel, with
and without bias), and with the GEMM it registers for the "linear" layer op
their output stays close to the float layer's. A method that only reads
checkpoints of its own format (`quantizes_float=False`: GPTQ, AWQ, GGUF ...)
converts no float layer; its tests write checkpoints in that format."""

from __future__ import annotations

import importlib.util
from typing import Any

from pagedllm.testing.components import instantiate, registration
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "quantization_method"
SUITE = Suite(KIND)

# Weight-only 8-bit keeps a random layer's output within about 1 %; 4-bit within about 10 %.
MAX_RELATIVE_ERROR = 0.15


def _method(rule: str, name: str) -> tuple[Any, str]:
    """(an instance, the compute dtype to test in), or RuleSkipped."""
    info = registration(rule, KIND, name).info
    missing = [p for p in info.requires if importlib.util.find_spec(p) is None]
    if missing:
        raise RuleSkipped(rule, f"{name!r} requires {', '.join(missing)}, not installed")
    if info.device_types is not None and "cpu" not in info.device_types:
        raise RuleSkipped(rule, f"{name!r} runs on {', '.join(info.device_types)}, the suite on cpu")
    dtype = "float32" if info.dtypes is None or "float32" in info.dtypes else info.dtypes[0]
    return instantiate(rule, KIND, name), dtype


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports, subclasses QuantizationMethod and is built with no arguments."""
    _method("loads", name)


@SUITE.rule("output-close-to-float")
def check_close(name: str) -> None:
    """Each layer it converts gives the float layer's output within a relative
    error of MAX_RELATIVE_ERROR; it converts at least one of them."""
    import torch

    from pagedllm.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.model_registry.layers.ops import OpRegistry, bind_layer_ops

    rule = "output-close-to-float"
    if not registration(rule, KIND, name).info.quantizes_float:
        raise RuleSkipped(rule, f"{name!r} only reads checkpoints in its own format (quantizes_float=False)")
    method, dtype_name = _method(rule, name)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    converted = 0
    for layer_cls, bias, prefix in (
        (ColumnParallelLinear, False, "model.layers.0.self_attn.qkv_proj"),
        (RowParallelLinear, False, "model.layers.0.self_attn.o_proj"),
        (ColumnParallelLinear, True, "model.layers.0.mlp.gate_up_proj"),
        (RowParallelLinear, True, "model.layers.0.mlp.down_proj"),
    ):
        layer = layer_cls(128, 64, bias=bias).to(dtype)
        x = torch.randn(5, 128, dtype=dtype)
        with torch.no_grad():
            expected = layer(x).float()
            if not method.quantize_linear(layer, prefix):
                continue
            # The layer then asks the op registry for its GEMM, as a worker's layers do.
            registry = OpRegistry()
            method.register_layer_ops(registry.register)
            bind_layer_ops(layer, registry)
            converted += 1
            actual = layer(x).float()
        error = ((actual - expected).norm() / expected.norm()).item()
        if not error <= MAX_RELATIVE_ERROR:
            raise ConformanceError(rule, f"{prefix}: relative error {error:.3g} > {MAX_RELATIVE_ERROR}")
    if converted == 0:
        raise ConformanceError(rule, "quantize_linear() converted none of the four linear layers")
