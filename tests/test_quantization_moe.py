"""int8 weight-only on mixture-of-experts layers (issue 34): each expert's
w13 and w2 rounded per output channel, the "fused_moe" kernel the int8
method registers against the layer's reference over the dequantized
weights, the expert storage halved in bfloat16, and the tiny GPT-OSS and
DeepSeek-V2 served with quantization="int8" against the float model (the
latent attention's kv_b_proj, read raw for absorption, stays in float)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_deepseek import build_deepseek
from test_models_gpt_oss import build_gpt_oss

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.quantization.base import QuantizationMethod
from pagedllm.quantization.int8 import Int8WeightOnlyMethod, quantize_per_channel
from pagedllm.worker.layer_ops import prepare_layer_ops
from pagedllm.worker.quantize import ConvertedLayers, quantize_model

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 4, 2, 32, 16


def _moe(dtype: torch.dtype, *, bias: bool, activation: str, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(RouterConfig(NUM_EXPERTS, TOP_K), HIDDEN, INTERMEDIATE, bias=bias, activation=activation,
                     swiglu_limit=3.0 if activation == "swigluoai" else None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return layer.to(dtype)


def _dequantized_copy(layer: FusedMoE) -> FusedMoE:
    """A float layer whose expert weights are the int8 method's q * scale."""
    reference = _moe(torch.float32, bias=layer.w13_bias is not None, activation=layer.activation)
    with torch.no_grad():
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            for expert in range(NUM_EXPERTS):
                q, scale = quantize_per_channel(weight[expert])
                # The layer keeps its scales in the compute dtype, as the dense int8 layers do.
                scale = scale.to(weight.dtype).float()
                getattr(reference, name)[expert] = q.float() * scale[:, None]
        for name in ("w13_bias", "w2_bias"):
            if getattr(layer, name) is not None:
                getattr(reference, name).copy_(getattr(layer, name).float())
    return reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("swigluoai", True)], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("num_tokens", [3, 40], ids=["decode-sized", "prefill-sized"])
def test_the_int8_moe_op_is_the_reference_over_dequantized_experts(
    dtype: torch.dtype, activation: str, bias: bool, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed_rows: list[int] = []
    packed_mm = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda x, q, s: packed_rows.append(len(x)) or packed_mm(x, q, s))
    layer = _moe(dtype, bias=bias, activation=activation)
    reference = _dequantized_copy(layer)
    method = Int8WeightOnlyMethod()
    assert method.quantize_moe(layer, "model.layers.0.mlp.experts")
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.int8
    assert layer.w13_weight_scale.shape == (NUM_EXPERTS, 2 * INTERMEDIATE)
    assert layer.w2_weight_scale.shape == (NUM_EXPERTS, HIDDEN) and layer.w2_weight_scale.dtype == dtype
    # The int8 kernel wins the "fused_moe" op over any platform's float kernel.
    assert prepare_layer_ops(layer, CpuPlatform(), method) == {"int8": 1}
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    router_logits = torch.randn(num_tokens, NUM_EXPERTS, generator=generator)
    with torch.no_grad():
        expected = reference(x.float(), router_logits)
        actual = layer(x, router_logits)
    assert actual.dtype == dtype
    # To rounding: float32's, or bfloat16's of the activations and of h (outputs here reach ~20).
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype] * float(expected.abs().max())
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=0)
    # Both layers routed the same tokens (the router reads the same logits).
    assert layer.take_expert_counts().tolist() == reference.take_expert_counts().tolist()
    # Experts with at most 8 rows run torch's packed int8 kernel (two GEMMs
    # each); more rows use the dequantized GEMM.
    if num_tokens == 3:
        assert len(packed_rows) >= 2 and all(rows <= 8 for rows in packed_rows)


def test_int8_halves_the_expert_storage_in_bfloat16() -> None:
    layer = _moe(torch.bfloat16, bias=True, activation="swigluoai")
    float_bytes = sum(w.nbytes for w in (layer.w13_weight, layer.w2_weight))
    assert Int8WeightOnlyMethod().quantize_moe(layer, "experts")
    int8_bytes = sum(w.nbytes for w in (layer.w13_weight, layer.w2_weight))
    scale_bytes = sum(s.nbytes for s in (layer.w13_weight_scale, layer.w2_weight_scale))
    assert int8_bytes == float_bytes // 2
    # One bfloat16 scale per output row: [E, 2I] + [E, H].
    assert scale_bytes == 2 * NUM_EXPERTS * (2 * INTERMEDIATE + HIDDEN)
    assert (layer.w13_bias is not None and layer.w13_bias.dtype == torch.bfloat16)  # biases stay as loaded


class LinearOnlyMethod(QuantizationMethod):
    """A method written before quantize_moe: it converts no MoE layer."""

    def quantize_linear(self, layer: Any, prefix: str) -> bool:
        return False


def test_the_worker_offers_every_moe_layer_and_a_method_without_the_hook_leaves_them() -> None:
    model = torch.nn.ModuleDict({
        "a": _moe(torch.float32, bias=False, activation="silu"),
        "b": _moe(torch.float32, bias=False, activation="silu"),
    })
    assert quantize_model(model, LinearOnlyMethod()) == ConvertedLayers(linear=0, moe=0)
    assert all(layer.w13_weight.dtype == torch.float32 for layer in model.values())  # type: ignore[union-attr]
    assert quantize_model(model, Int8WeightOnlyMethod()) == ConvertedLayers(linear=0, moe=2)
    assert all(layer.w13_weight.dtype == torch.int8 for layer in model.values())  # type: ignore[union-attr]


# ---- the tiny GPT-OSS through the engine --------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Teacher forcing: each position's top token and the given next token's log-probability.
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")


def _score(llm: LLM, sequences: list[list[int]]) -> tuple[list[int], list[float]]:
    """Over every position after the first: the top token, and the log-probability of the sequence's token."""
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], SCORE, use_tqdm=False)  # type: ignore[misc]
    top, given = [], []
    for sequence, output in zip(sequences, outputs, strict=True):
        assert output.prompt_logprobs is not None
        for token, entry in zip(sequence[1:], output.prompt_logprobs[1:], strict=True):
            assert entry is not None
            top.append(next(t for t, lp in entry.items() if lp.rank == 1))
            given.append(entry[token].logprob)
    return top, given


def _float_then_int8(checkpoint: Path, check_int8_model: Any) -> tuple[list[int], list[int], list[float], list[float]]:
    """(top, float top, log-probabilities, float log-probabilities) over the
    float model's greedy continuations, scored by both models."""
    prompts = [[(7 * i + 13 * j) % 500 + 8 for j in range(n)] for i, n in enumerate((5, 11, 19, 26))]
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)  # type: ignore[misc]
        sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
        expected_top, expected_logprobs = _score(llm, sequences)
    finally:
        llm.shutdown()
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False,
              quantization="int8")
    try:
        check_int8_model(llm.engine_core.engine_core.model_executor.driver_worker.model)  # type: ignore[attr-defined]
        top, logprobs = _score(llm, sequences)
    finally:
        llm.shutdown()
    return top, expected_top, logprobs, expected_logprobs


def _assert_agrees(top: list[int], expected_top: list[int], logprobs: list[float], expected_logprobs: list[float],
                   max_error: float = 0.1, mean_error: float = 0.02) -> None:
    # Over the same sequences (the float model's greedy continuations): the
    # top token agrees almost everywhere (rounding may flip a near-tie), and
    # the log-probabilities are close.
    same = sum(a == b for a, b in zip(top, expected_top, strict=True))
    errors = (torch.tensor(logprobs) - torch.tensor(expected_logprobs)).abs()
    assert same >= 0.9 * len(top), (same, len(top))
    assert errors.max() < max_error and errors.mean() < mean_error, errors


def test_gpt_oss_served_in_int8_agrees_with_float(checkpoint: Path) -> None:
    def check(model: torch.nn.Module) -> None:
        moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert len(moe_layers) == 2
        assert all(m.w13_weight.dtype == m.w2_weight.dtype == torch.int8 and m.op_impl == "int8"
                   for m in moe_layers)

    _assert_agrees(*_float_then_int8(checkpoint, check))


def test_deepseek_served_in_int8_agrees_with_float(tmp_path: Path) -> None:
    """Every linear layer and the experts int8 but kv_b_proj, which the
    latent attention absorbs as a float matrix, and the routers (both
    `skip_quantization`): int8 rounding of the router logits would flip
    near-tie expert choices, which the builder's varied routing has many of
    (about half the top tokens then differed). The largest log-probability
    error left, ~0.47, is a position where the other layers' rounding still
    flips an expert."""

    def check(model: torch.nn.Module) -> None:
        layers = dict(model.named_modules())
        kv_b = [name for name in layers if name.endswith("kv_b_proj")]
        assert len(kv_b) == 2 and all(layers[name].weight.dtype == torch.float32 for name in kv_b)
        gates = [name for name in layers if name.endswith("mlp.gate")]
        assert gates and all(layers[name].weight.dtype == torch.float32 for name in gates)
        for name in ("o_proj", "q_proj", "kv_a_proj_with_mqa"):
            assert layers[f"model.layers.0.self_attn.{name}"].weight.dtype == torch.int8
        assert any(getattr(layer, "w13_weight", None) is not None and layer.w13_weight.dtype == torch.int8
                   for layer in layers.values())

    checkpoint = build_deepseek("DeepseekV2ForCausalLM", tmp_path / "model")
    top, expected_top, logprobs, expected_logprobs = _float_then_int8(checkpoint, check)
    _assert_agrees(top, expected_top, logprobs, expected_logprobs, max_error=0.6, mean_error=0.05)
