"""The CPU platform's "fused_moe" kernel (platforms/cpu/fused_moe.py,
csrc/fused_moe.c) against the layer's reference, `FusedMoE.forward_reference`.

Each of its paths (the C decode kernel, the grouped oneDNN GEMMs, the
gather + bmm torch fallback) is run on every batch size, whatever size it
is chosen for, over ragged expert loads with experts left empty. float32
must match to float32 rounding (only the GEMMs' summation order differs);
bfloat16 rounds where the reference rounds, so all but the odd element
match to the bit and the rest to a bfloat16 ulp. The decode path is
captured in a CpuGraph and replayed with other routing.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags
from test_models_gpt_oss import build_gpt_oss

from pagedllm.core.errors import GraphCaptureError
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig, select_experts
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu import fused_moe as cpu_moe
from pagedllm.platforms.cpu.graph import CpuGraph
from pagedllm.worker.layer_ops import prepare_layer_ops

pytestmark = NO_COMPILER

DTYPES = [torch.float32, torch.bfloat16]
NUM_EXPERTS, HIDDEN, INTER = 10, 80, 40  # not multiples of the kernel's 16-row blocks or 32-lane loops
EMPTY_EXPERTS = (3, 9)  # never routed to
PATHS = ["decode_kernel", "grouped_gemms", "decode_gathered", "__call__"]


def _layer(dtype: torch.dtype, activation: str = "silu", bias: bool = False, top_k: int = 2,
           seed: int = 0) -> FusedMoE:
    layer = FusedMoE(RouterConfig(NUM_EXPERTS, top_k), HIDDEN, INTER, bias=bias, activation=activation,
                     swiglu_limit=1.5 if activation == "swigluoai" else None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.data = (torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5).to(dtype)
    return layer  # its expert_counts stay float32, as a model's built in its dtype


def _routing(layer: FusedMoE, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, topk_weights, topk_ids): loads skewed towards the low experts,
    EMPTY_EXPERTS never chosen."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator) + torch.linspace(2, -2, NUM_EXPERTS)
    logits[:, list(EMPTY_EXPERTS)] = -1e9
    topk_weights, topk_ids = select_experts(logits, layer.router)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(layer.w13_weight.dtype)
    return x, topk_weights, topk_ids


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    ulp = 2**-7
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp, atol=ulp)
    assert (actual == expected).float().mean() > 0.95


def _run(path: str, kernel: cpu_moe.CpuFusedMoE) -> Callable[..., torch.Tensor]:
    if path == "decode_kernel":
        library = cpu_moe.load()
        assert library is not None  # with a compiler, the kernel must build
        return lambda *args: kernel.decode_kernel(library, *args)
    return getattr(kernel, path)  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("silu", True), ("swigluoai", True),
                                                  ("swigluoai", False)])
def test_each_path_gives_the_reference_over_ragged_loads(path: str, dtype: torch.dtype, activation: str,
                                                         bias: bool) -> None:
    for top_k in (1, 2, 4, 7):
        layer = _layer(dtype, activation, bias, top_k, seed=top_k)
        run = _run(path, cpu_moe.build(layer))
        for tokens in (1, 3, 32, 33, 100):
            x, topk_weights, topk_ids = _routing(layer, tokens, seed=tokens)
            counts = torch.bincount(topk_ids.flatten(), minlength=NUM_EXPERTS)
            assert counts[list(EMPTY_EXPERTS)].sum() == 0
            expected = layer.forward_reference(x, topk_weights, topk_ids)
            _assert_matches(run(x, topk_weights, topk_ids), expected)


def test_the_reference_path_is_not_trivially_matched() -> None:
    """The comparison can fail: another expert's weights change the answer."""
    layer = _layer(torch.float32, top_k=2)
    x, topk_weights, topk_ids = _routing(layer, 5, seed=1)
    expected = layer.forward_reference(x, topk_weights, topk_ids)
    kernel = cpu_moe.build(layer)
    with torch.no_grad():
        layer.w2_weight[topk_ids[0, 0]] += 0.01  # the kernel reads the layer's weights in place
    with pytest.raises(AssertionError):
        _assert_matches(_run("decode_kernel", kernel)(x, topk_weights, topk_ids), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [4, cpu_moe.DECODE_MAX_TOKENS + 16])
def test_a_captured_moe_layer_replays_new_routing_as_eager(dtype: torch.dtype, tokens: int) -> None:
    """The whole layer (router, expert counts, kernel) as a decode graph; a
    size above DECODE_MAX_TOKENS is captured on the C kernel too."""
    layer = _layer(dtype, "swigluoai", bias=True, top_k=3)
    prepare_layer_ops(layer, CpuPlatform())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    graph = CpuGraph.capture(lambda: layer(x, logits))
    layer.take_expert_counts()
    for step in range(3):
        x.copy_(torch.randn(tokens, HIDDEN, generator=generator))
        logits.copy_(torch.randn(tokens, NUM_EXPERTS, generator=generator) * (step + 1))
        graph.replay()
        assert graph.output is not None
        replay_counts = layer.take_expert_counts()
        topk_weights, topk_ids = select_experts(logits, layer.router)
        assert torch.equal(replay_counts, torch.bincount(topk_ids.flatten(), minlength=NUM_EXPERTS).float())
        eager = layer(x, logits)  # the same kernel at decode sizes, the grouped GEMMs above
        if tokens <= cpu_moe.DECODE_MAX_TOKENS:
            assert torch.equal(graph.output, eager)
        _assert_matches(graph.output, eager)
        layer.take_expert_counts()
        _assert_matches(graph.output, layer.forward_reference(x, topk_weights, topk_ids))


def test_without_the_c_kernel_decode_sizes_capture_the_torch_gather_and_prefill_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(torch.bfloat16, top_k=2)
    kernel = cpu_moe.build(layer)
    monkeypatch.setattr(cpu_moe, "load", lambda: None)
    x, topk_weights, topk_ids = _routing(layer, 4, seed=0)
    graph = CpuGraph.capture(lambda: kernel(x, topk_weights, topk_ids))
    x2, weights2, ids2 = _routing(layer, 4, seed=1)
    x.copy_(x2), topk_weights.copy_(weights2), topk_ids.copy_(ids2)
    graph.replay()
    assert graph.output is not None
    _assert_matches(graph.output, layer.forward_reference(x, topk_weights, topk_ids))
    big = _routing(layer, cpu_moe.GATHER_MAX_BYTES // (2 * kernel.expert_bytes) + 1, seed=2)  # too much to gather
    with pytest.raises(GraphCaptureError, match="host-side counts"):
        CpuGraph.capture(lambda: kernel(*big))


def test_the_cpu_platform_binds_the_kernel_and_the_switch_turns_the_c_kernel_off(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    layer, half = _layer(torch.bfloat16), _layer(torch.float16)
    assert prepare_layer_ops(layer, CpuPlatform()) == {"cpu_moe": 1}
    assert isinstance(layer.op_kernel, cpu_moe.CpuFusedMoE)
    assert prepare_layer_ops(half, CpuPlatform()) == {"torch": 1}  # float16: the reference
    x, topk_weights, topk_ids = _routing(layer, 2, seed=0)
    _assert_matches(layer.apply_experts(x, topk_weights, topk_ids), layer.forward_reference(x, topk_weights, topk_ids))

    monkeypatch.setenv(cpu_moe.ENV_SWITCH, "0")
    cpu_moe.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=cpu_moe.__name__):
            assert cpu_moe.load() is None
        assert f"{cpu_moe.ENV_SWITCH}=0" in caplog.text
        _assert_matches(layer.apply_experts(x, topk_weights, topk_ids),
                        layer.forward_reference(x, topk_weights, topk_ids))
    finally:
        monkeypatch.delenv(cpu_moe.ENV_SWITCH)
        cpu_moe.load.cache_clear()


@pytest.mark.slow
def test_a_moe_model_replays_decode_graphs_with_the_eager_tokens(tmp_path: Path) -> None:
    """GPT-OSS (FusedMoE experts) in the engine: before the kernel, its
    reference refused capture and every decode step ran eagerly."""
    from pagedllm import LLM, SamplingParams

    checkpoint = build_gpt_oss(tmp_path / "gpt-oss")
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 40 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, enforce_eager=eager)
        tokens[eager] = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner  # type: ignore[attr-defined]
    assert runner is not None and runner.num_replays > 0
    assert tokens[False] == tokens[True]


# The kernel as built for older CPUs: skylake-avx512 (AVX-512 without BF16
# conversions), x86-64-v3 (the portable loops).
@pytest.mark.parametrize("march", ["skylake-avx512", "x86-64-v3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_older_cpu_builds_give_the_reference(march: str, dtype: torch.dtype,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    needs = {"skylake-avx512": {"avx512f", "avx512bw", "avx512vl"}, "x86-64-v3": {"avx2", "fma"}}[march]
    if platform.machine() != "x86_64" or not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march} code")
    library = cpu_moe.declare(build_for_march(cpu_moe.SOURCE, cpu_moe.CFLAGS, march, tmp_path_factory.mktemp(march)))
    layer = _layer(dtype, "swigluoai", bias=True, top_k=4)
    kernel = cpu_moe.build(layer)
    for tokens in (1, 9):
        x, topk_weights, topk_ids = _routing(layer, tokens, seed=tokens)
        _assert_matches(kernel.decode_kernel(library, x, topk_weights, topk_ids),
                        layer.forward_reference(x, topk_weights, topk_ids))
