"""The quantization-method kind (issue 17 point 3): the built-in weight-only
`int8` against plain-torch references (per-channel rounding, the GEMM), on
the shipped model (greedy tokens agree with float, validation perplexity
within 2 % of float's, the linear weights stored as int8), a method
registered by a test plugin selected by name, and the errors for a method
that is unknown or cannot run here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
from helpers.validation import validation_sample, validation_score
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError, UnknownComponentError
from pagedllm.kv_connectors.base import model_fingerprint
from pagedllm.model_registry.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu import amx_linear as cpu_amx_linear
from pagedllm.platforms.cpu import grouped_linear as cpu_grouped_linear
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.int8 import Int8WeightOnlyMethod, quantize_per_channel
from pagedllm.worker.layer_ops import prepare_layer_ops

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\nimport sys\n",
           "for i in range(10):", "# Read the file\nwith open(path) as f:", "x = [1, 2, 3]\ny ="]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_each_output_channel_is_rounded_to_int8_with_its_own_scale() -> None:
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 7)[:, None]
    weight[3] = 0.0  # an all-zero row keeps a usable scale
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    expected_scale = weight.abs().amax(dim=1) / 127
    torch.testing.assert_close(scale[[0, 1, 2, 4, 5]], expected_scale[[0, 1, 2, 4, 5]], rtol=0, atol=0)
    assert q[3].eq(0).all() and scale[3] > 0
    # Each row's largest magnitude is exactly +-127; every value within half a step.
    assert q[[0, 1, 2, 4, 5]].abs().amax(dim=1).eq(127).all()
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize(("in_features", "num_rows"), [(32, 1), (32, 8), (32, 9), (48, 8), (24, 1)],
                         ids=["grouped-kernel", "grouped-kernel-8-rows", "dequantized-gemm", "packed-mm",
                              "off-its-grid"])
def test_the_int8_gemm_is_x_times_the_dequantized_weight(
    layer_cls: type[nn.Linear], dtype: torch.dtype, in_features: int, num_rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed_calls: list[int] = []
    packed_mm = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, q, s: packed_calls.append(len(x)) or packed_mm(x, q, s))
    amx_calls: list[int] = []
    amx_int8 = cpu_amx_linear.linear_int8
    monkeypatch.setattr(cpu_amx_linear, "linear_int8", lambda x, *args: amx_calls.append(len(x)) or amx_int8(x, *args))
    grouped_calls: list[int] = []
    grouped_call = cpu_grouped_linear.GroupedLinearKernel.__call__
    monkeypatch.setattr(cpu_grouped_linear.GroupedLinearKernel, "__call__",
                        lambda self, x, bias: grouped_calls.append(len(x.reshape(-1, x.shape[-1])))
                        or grouped_call(self, x, bias))
    torch.manual_seed(1)
    layer = layer_cls(in_features, 16, bias=True).to(dtype)  # type: ignore[call-arg]
    q, scale = quantize_per_channel(layer.weight)
    bias = layer.bias.detach().clone()
    method = Int8WeightOnlyMethod()
    assert method.quantize_linear(layer, "proj")
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == dtype
    # The int8 GEMM wins the "linear" op over any platform's float GEMM.
    assert prepare_layer_ops(layer, CpuPlatform(), method) == {"int8": 1}
    x = torch.randn(num_rows, 1, in_features).to(dtype)
    reference = x.float() @ (q.float() * scale[:, None]).T + bias.float()
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(layer(x).float(), reference, atol=tolerance, rtol=tolerance)
    # bfloat16 on an AMX CPU: the platform's AMX kernel (K a multiple of 32);
    # else the grouped-weight decode kernel (K a multiple of 32, AVX-512) at
    # decode-sized batches, torch's packed kernel for those on its grid;
    # the dequantized GEMM otherwise.
    on_amx = dtype == torch.bfloat16 and in_features % 32 == 0 and cpu_amx_linear.load() is not None
    library = cpu_grouped_linear.load()
    on_grouped = (not on_amx and in_features % 32 == 0 and num_rows <= cpu_grouped_linear.DECODE_MAX_ROWS
                  and library is not None and library.decode_kernel)
    assert amx_calls == ([num_rows] if on_amx else [])
    assert grouped_calls == ([num_rows] if on_grouped else [])
    assert packed_calls == ([num_rows] if in_features % 16 == 0 and num_rows <= 8 and not (on_amx or on_grouped)
                            else [])


def _greedy_tokens(**engine: object) -> tuple[list[list[int]], LLM]:
    llm = LLM("tiny", dtype="float32", **engine)  # type: ignore[arg-type]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def _model(llm: LLM) -> nn.Module:
    return llm.engine_core.engine_core.model_executor.driver_worker.model  # type: ignore[attr-defined,no-any-return]


def test_int8_stores_every_linear_but_the_lm_head_as_int8_and_agrees_with_float() -> None:
    expected, reference = _greedy_tokens()
    reference.shutdown()
    tokens, llm = _greedy_tokens(quantization="int8")
    try:
        model = _model(llm)
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        assert {name for name, m in linears.items() if m.weight.dtype == torch.int8} == {
            name for name in linears if not name.endswith("lm_head")}
        assert linears["lm_head"].weight.dtype == torch.float32
    finally:
        llm.shutdown()
    # The first tokens are the same everywhere; rounding may flip a near-tie later.
    assert [t[0] for t in tokens] == [t[0] for t in expected]
    same = sum(a == b for got, want in zip(tokens, expected, strict=True) for a, b in zip(got, want, strict=True))
    assert same >= 0.9 * len(PROMPTS) * GREEDY.max_tokens, (same, tokens, expected)


@pytest.mark.slow
def test_int8_validation_perplexity_is_within_2_percent_of_float() -> None:
    windows, bos_id = validation_sample()
    perplexities = {}
    for quantization in (None, "int8"):
        llm = LLM("tiny", dtype="float32", quantization=quantization)
        try:
            perplexities[quantization] = validation_score(llm, windows, bos_id).perplexity
        finally:
            llm.shutdown()
    assert perplexities[None] < 45.0, perplexities  # the trained model, not noise
    assert perplexities["int8"] <= 1.02 * perplexities[None], perplexities


# ------------------------------------------------------------- the kind


class RecordingMethod(QuantizationMethod):
    """Leaves every layer as loaded and records which ones it was offered."""

    offered: ClassVar[list[str]] = []

    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        RecordingMethod.offered.append(prefix)
        return False


class TestQuantizationPlugin:
    @hookimpl
    def register_quantization_methods(self, register: RegisterFn) -> None:
        register("recording", RecordingMethod)
        register("cuda_only", RecordingMethod, device_types=["cuda"], dtypes=["float16"])


@pytest.fixture
def quantization_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(TestQuantizationPlugin(), name="test-quantization")
    RecordingMethod.offered = []
    yield
    pm.unregister(name="test-quantization")


def test_a_method_registered_by_a_plugin_is_selected_by_name(quantization_plugin: None) -> None:
    expected, reference = _greedy_tokens()
    reference.shutdown()
    tokens, llm = _greedy_tokens(quantization="recording")
    try:
        linears = [name for name, m in _model(llm).named_modules()
                   if isinstance(m, nn.Linear) and not name.endswith("lm_head")]
    finally:
        llm.shutdown()
    assert RecordingMethod.offered == linears and len(linears) > 0
    assert tokens == expected  # nothing converted: float's tokens exactly


def test_a_method_that_cannot_run_here_is_a_config_error_before_loading(quantization_plugin: None) -> None:
    refused = (r"model.quantization='cuda_only' is invalid; allowed: a method that runs here "
               r"\(cuda_only runs on cuda, not cpu; computes in float16, not float32\)")
    with pytest.raises(ConfigError, match=refused):
        LLM("tiny", dtype="float32", quantization="cuda_only")
    assert RecordingMethod.offered == []


def test_an_unknown_method_lists_the_registered_ones() -> None:
    registered = ", ".join(sorted(get_plugin_manager().quantization_methods.names()))
    assert "int8" in registered
    with pytest.raises(UnknownComponentError, match=rf"no quantization_method named 'int3'; registered: {registered}"):
        LLM("tiny", dtype="float32", quantization="int3")


def test_a_checkpoint_format_reader_refuses_a_float_checkpoint() -> None:
    with pytest.raises(ConfigError, match=r"model.quantization='gptq' is invalid; allowed: a method that quantizes "
                                          r"a float checkpoint at load \(gptq only reads checkpoints"):
        LLM("tiny", dtype="float32", quantization="gptq")


def test_the_builtin_method_is_registered_and_serve_takes_the_flag() -> None:
    from pagedllm.entrypoints.cli import build_parser, serve_config

    registry = get_plugin_manager().quantization_methods
    builtins = {name: registry.get(name).target for name in registry.names()}
    assert builtins["int8"] == "pagedllm.quantization.int8:Int8WeightOnlyMethod"
    # The others read their own checkpoint format and quantize no float checkpoint.
    readers = {name: registry.get(name).info for name in builtins if name != "int8"}
    assert readers and all(info.checkpoint_formats and not info.quantizes_float for info in readers.values())
    assert registry.get("int8").info.quantizes_float
    assert registry.get("gptq").info.checkpoint_formats == ("gptq",)
    assert registry.get("awq").info.checkpoint_formats == ("awq",)
    assert registry.get("gguf").info.checkpoint_formats == ("gguf",)
    args = build_parser().parse_args(["serve", "tiny", "--quantization", "int8"])
    assert serve_config(args).model.quantization == "int8"


def test_kv_blocks_of_another_quantization_are_another_fingerprint(tmp_path: object) -> None:
    facts = (str(tmp_path), torch.float32, 16, 2, 2, 8)
    plain, int8 = model_fingerprint(*facts), model_fingerprint(*facts, quantization="int8")
    assert plain != int8 and int8 == model_fingerprint(*facts, quantization="int8")
