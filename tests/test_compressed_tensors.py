"""compressed-tensors checkpoints (llm-compressor's format): W8A16, W4A16,
W8A8-INT8, FP8 weight-only and FP8 W8A8, and fp8 KV-cache scales.

Checkpoints are written from the tiny float Llama by hand (helpers/compressed_tensors_writer.py), following
the format (config validated by the compressed-tensors package, int4
packed by its own `pack_to_int32`), round-to-nearest with min-max scales
and no calibration but the static input scales. Every greedy run is checked
against transformers in float32 on the dequantized weights, with the same
activation quantization applied by forward pre-hooks on its linear layers;
each layer kind against a plain-torch reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.compressed_tensors_writer import (
    FP8,
    LIMIT,
    LINEAR_SUFFIXES,
    SCHEMES,
    scheme_args,
    write_compressed_tensors,
)
from helpers.tiny_models import cached_tiny_model
from helpers.validation import greedy_token_ids
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.loader import ModelLoadError
from pagedllm.quantization.compressed_tensors.scaled_linear import ScaledWeight, scaled_linear

PROMPTS = [[1, 5, 9, 14, 22, 7], [3, 3, 8]]
MAX_TOKENS = 8


def write_checkpoint(tmp_path: Path, scheme: str, kv_scales: dict[int, tuple[float, float]] | None = None,
                     **config_changes: Any) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The tiny Llama in `scheme` (helpers/compressed_tensors_writer.py)."""
    source = cached_tiny_model("llama", with_tokenizer=True)
    return write_compressed_tensors(source, tmp_path, scheme, PROMPTS, kv_scales, **config_changes)


def _fake_quantize_input(x: torch.Tensor, args: dict[str, Any], input_scale: torch.Tensor | None) -> torch.Tensor:
    """vLLM's activation quantization, quantized and dequantized in float32."""
    limit = LIMIT[args["type"]]
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / limit \
        if input_scale is None else input_scale
    if args["type"] == "int":
        return torch.round(x / scale).clamp(-128, 127) * scale
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


def _add_input_hooks(model: nn.Module, args: dict[str, Any] | None, input_scales: dict[str, torch.Tensor]) -> None:
    if args is None:
        return
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEAR_SUFFIXES:
            scale = input_scales.get(name)
            module.register_forward_pre_hook(lambda _m, inputs, s=scale: (_fake_quantize_input(inputs[0], args, s),))


def _greedy(path: Path, **kwargs: Any) -> list[list[int]]:
    return greedy_token_ids(path, PROMPTS, MAX_TOKENS, **kwargs)


def _hf_greedy(dequantized: Path, scheme: str, input_scales: dict[str, torch.Tensor]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32)
    _add_input_hooks(hf, SCHEMES[scheme][1], input_scales)
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_compressed_tensors_checkpoint_gives_transformers_tokens(tmp_path: Path, scheme: str) -> None:
    """Served without --quantization; the tokens are transformers' on the
    dequantized weights, activations quantized as the scheme says."""
    quantized, dequantized, input_scales = write_checkpoint(tmp_path, scheme)
    assert _greedy(quantized) == _hf_greedy(dequantized, scheme, input_scales)


def test_w8a8_int8_at_tensor_parallel_size_2(tmp_path: Path) -> None:
    quantized, dequantized, input_scales = write_checkpoint(tmp_path, "w8a8_int8_static")
    assert _greedy(quantized, tensor_parallel_size=2) == _hf_greedy(dequantized, "w8a8_int8_static", input_scales)


@pytest.mark.parametrize("codes_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("static", [False, True])
def test_the_w8a8_gemm_is_the_plain_torch_reference(codes_dtype: torch.dtype, static: bool) -> None:
    torch.manual_seed(0)
    x, w, bias = torch.randn(5, 64), torch.randn(24, 64), torch.randn(24)
    kind = "int" if codes_dtype == torch.int8 else "float"
    scales = w.abs().amax(dim=1) / LIMIT[kind]
    codes = (w / scales[:, None])
    codes = codes.round().to(torch.int8) if kind == "int" else codes.to(FP8)
    input_scale = x.abs().amax() / LIMIT[kind] if static else None
    out = scaled_linear(x, ScaledWeight(codes, scales, input_scale, True), bias)
    args = scheme_args(kind, "tensor" if static else "token")
    expected = _fake_quantize_input(x, args, input_scale) @ (codes.float() * scales[:, None]).t() + bias
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes, message", [
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}}, "sparse-24-bitmask"),
    ({"config_groups": {"g": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                              "weights": scheme_args("float", "tensor_group", bits=4, group_size=16)}}},
     "format 'nvfp4-pack-quantized'"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": scheme_args("int", "group", bits=4, group_size=32),
                              "input_activations": scheme_args("int", "token", dynamic=True),
                              "format": "pack-quantized"}}},
     r"scheme weights int4 group group_size=32, input_activations int8 token dynamic"),
    ({"kv_cache_scheme": scheme_args("int", "tensor")}, "kv_cache_scheme int8 tensor"),
])
def test_an_unsupported_scheme_is_a_model_load_error_naming_it(tmp_path: Path, changes: dict[str, Any],
                                                                message: str) -> None:
    quantized, _, _ = write_checkpoint(tmp_path, "w8a16_channel")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(changes)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(quantized), dtype="float32", num_kv_blocks=32)


KV_SCALES = {0: (0.02, 0.01), 1: (0.03, 0.015)}


def _driver_model(llm: LLM) -> nn.Module:
    return llm.engine_core.engine_core.model_executor.driver_worker.model_runner.model  # type: ignore[no-any-return]


def test_checkpoint_kv_scales_reach_the_fp8_cache_writes(tmp_path: Path) -> None:
    """The stored fp8 K and V are round-to-fp8(K / k_scale), (V / v_scale) of
    each layer's own k_scale / v_scale (self_attn.k_scale in the checkpoint)."""
    quantized, _, _ = write_checkpoint(tmp_path, "w8a16_channel", kv_scales=KV_SCALES)
    llm = LLM(model=str(quantized), dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    try:
        written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        layers = _driver_model(llm).get_attention_layers()
        for layer in layers:
            layer.register_forward_pre_hook(lambda _m, args, out=written: out.append(
                (args[1].clone(), args[2].clone(), args[3].slot_mapping.clone())))
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        for index, layer in enumerate(layers):
            k_scale, v_scale = KV_SCALES[index]
            assert (layer.impl.k_scale, layer.impl.v_scale) == (pytest.approx(k_scale), pytest.approx(v_scale))
            key, value, slots = written[index]
            cache = layer.kv_cache.view(torch.uint8).view(2, -1, layer.num_kv_heads, layer.head_size)
            for stored, x, scale in ((cache[0], key, layer.impl.k_scale), (cache[1], value, layer.impl.v_scale)):
                expected = (x.view(-1, layer.num_kv_heads, layer.head_size) / scale).clamp(-448, 448).to(FP8)
                assert torch.equal(stored[slots.long()], expected.view(torch.uint8))
    finally:
        llm.shutdown()


def test_an_fp8_cache_with_checkpoint_scales_matches_attention_over_the_rounded_kv(tmp_path: Path) -> None:
    """Greedy tokens equal transformers' with K and V rounded as the cache
    stores them (fp8 of K / k_scale, times k_scale); without --kv-cache-dtype
    fp8 the scales load and change nothing."""
    from transformers import AutoModelForCausalLM

    quantized, dequantized, _ = write_checkpoint(tmp_path, "w8a16_channel", kv_scales=KV_SCALES)
    hf = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32)
    expected_plain = _hf_greedy(dequantized, "w8a16_channel", {})
    assert _greedy(quantized) == expected_plain
    import transformers.models.llama.modeling_llama as llama

    original = llama.apply_rotary_pos_emb
    layer_of_call: list[int] = []

    def rounded_rope(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # K is cached after RoPE: round the rotated K, layer by layer in call order.
        q, k = original(q, k, *args, **kwargs)
        k_scale = KV_SCALES[len(layer_of_call) % len(KV_SCALES)][0]
        layer_of_call.append(0)
        return q, (k / k_scale).clamp(-448, 448).to(FP8).float() * k_scale

    for index, layer in enumerate(hf.model.layers):
        v_scale = KV_SCALES[index][1]
        layer.self_attn.v_proj.register_forward_hook(
            lambda _m, _i, out, s=v_scale: (out / s).clamp(-448, 448).to(FP8).float() * s)
    llama.apply_rotary_pos_emb = rounded_rope
    try:
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    finally:
        llama.apply_rotary_pos_emb = original
    assert _greedy(quantized, kv_cache_dtype="fp8") == expected
