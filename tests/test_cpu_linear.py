"""The CPU platform's oneDNN-prepacked GEMMs compute what F.linear computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_registry.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu import amx_linear as cpu_amx_linear
from pagedllm.platforms.cpu.linear import MKL_MAX_WEIGHT_ELEMENTS, onednn_linear_available
from pagedllm.quantization.int8 import Int8WeightOnlyMethod
from pagedllm.worker.layer_ops import prepare_layer_ops


def prepack_linear_layers(model: nn.Module) -> int:
    """Bind the model's layers as a CPU worker does; how many took the prepacked GEMM."""
    return prepare_layer_ops(model, CpuPlatform())["cpu_prepacked"]


@pytest.fixture(autouse=True)
def _onednn_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the oneDNN and MKL GEMMs: the AMX kernel that
    takes few-row bfloat16 batches on an AMX CPU has its own tests
    (test_cpu_amx_linear.py)."""
    monkeypatch.setattr(cpu_amx_linear, "load", lambda: None)


def _skip_without(dtype: torch.dtype) -> None:
    if not onednn_linear_available(dtype):
        pytest.skip(f"oneDNN's prepacked linear does not run in {dtype} here")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        ColumnParallelLinear(64, 96, bias=True),
        MergedColumnParallelLinear(96, [48, 48]),
        RowParallelLinear(96, 80, bias=True),
    )
    return model.to(dtype)


@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
def test_prepacked_bfloat16_linear_is_bit_identical_to_f_linear(num_rows: int) -> None:
    _skip_without(torch.bfloat16)
    model = _model(torch.bfloat16)
    x = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = [x]
        for layer in model:
            expected.append(F.linear(expected[-1], layer.weight, layer.bias))
        assert prepack_linear_layers(model) == 3
        out = x
        for layer, want in zip(model, expected[1:], strict=True):
            out = layer(out)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_prepacked_float32_linear_matches_f_linear() -> None:
    _skip_without(torch.float32)
    model = _model(torch.float32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = F.linear(F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight), model[2].weight,
                            model[2].bias)
        assert prepack_linear_layers(model) == 3
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_layers_are_bound_to_the_gemm_not_patched() -> None:
    _skip_without(torch.bfloat16)
    model = _model(torch.bfloat16)
    prepack_linear_layers(model)
    # Each layer keeps its class's forward and apply_linear (the collectives
    # stay); the op registry bound its GEMM once.
    for layer in model:
        assert "forward" not in vars(layer) and "apply_linear" not in vars(layer)
        assert layer.op_impl == "cpu_prepacked"


def test_int8_quantized_layers_keep_their_own_gemm() -> None:
    _skip_without(torch.bfloat16)
    model = _model(torch.bfloat16)
    method = Int8WeightOnlyMethod()
    method.quantize_linear(model[1], "1")
    assert prepare_layer_ops(model, CpuPlatform(), method) == {"cpu_prepacked": 2, "int8": 1}
    assert model[1].op_impl == "int8"
    assert model[1].weight.dtype == torch.int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_layers_trace_as_f_linear_under_torch_compile(dtype: torch.dtype) -> None:
    """`device.compile_model`: Inductor lowers only weights it packed itself, so
    a compiled graph must hold aten linear ops, not our prepacked oneDNN calls."""
    _skip_without(dtype)
    model = _model(dtype)
    x = torch.randn(5, 64).to(dtype)
    expected = model(x)
    assert prepack_linear_layers(model) == 3
    targets: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend)
    out = compiled(x)
    assert any("linear" in target for target in targets), targets
    assert not any("mkldnn" in target for target in targets), targets
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.equal(model(x), expected)  # eager calls still take the prepacked path, same values


def _ops_run(fn: Callable[[], Any]) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    return {event.key for event in profile.key_averages()}


def test_small_float32_weights_run_on_mkl_and_large_ones_on_prepacked_onednn() -> None:
    """A float32 weight of at most MKL_MAX_WEIGHT_ELEMENTS runs MKL's sgemm on
    a [K, N] copy (faster at decode sizes); a larger one stays on oneDNN."""
    _skip_without(torch.float32)
    generator = torch.Generator().manual_seed(2)
    small = ColumnParallelLinear(64, 96, bias=True)
    large = ColumnParallelLinear(512, 1025, bias=False)  # 524,800 elements > 1 << 19
    assert small.weight.numel() <= MKL_MAX_WEIGHT_ELEMENTS < large.weight.numel()
    x_small, x_large = torch.randn(3, 64, generator=generator), torch.randn(3, 512, generator=generator)
    with torch.no_grad():
        expected_small, expected_large = F.linear(x_small, small.weight, small.bias), F.linear(x_large, large.weight)
        assert prepack_linear_layers(nn.Sequential(small, large)) == 2
        small_ops = _ops_run(lambda: torch.testing.assert_close(small(x_small), expected_small, rtol=1e-5, atol=1e-5))
        large_ops = _ops_run(lambda: torch.testing.assert_close(large(x_large), expected_large, rtol=1e-5, atol=1e-5))
        assert "aten::addmm" in small_ops and "mkldnn::_linear_pointwise" not in small_ops
        assert "mkldnn::_linear_pointwise" in large_ops
        # [..., K] inputs keep their leading shape
        assert small(x_small.view(3, 1, 64)).shape == (3, 1, 96)
