"""GPT-OSS checkpoints with MXFP4 experts (the released format), dequantized
at load, against transformers loading the same files (float32).

The checkpoint is test_models_gpt_oss.py's tiny float one with each expert
matrix encoded here (`encode_mxfp4`: per 32-value block a power-of-two
scale, each value rounded to the nearest FP4 E2M1 number) into
`<proj>_blocks` / `<proj>_scales`, and `quantization_config` mxfp4 in
config.json. transformers reads it with `Mxfp4Config(dequantize=True)`
(its own dequantization, no kernel). The dequantization itself is checked
bit for bit against transformers' function on random blocks and scales.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_gpt_oss import build_gpt_oss, hf_generate, max_logit_error, run_paged_batches

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.loader import ModelLoadError, load_model
from pagedllm.model_registry.models.gpt_oss import GptOssForCausalLM
from pagedllm.model_registry.mxfp4 import FP4_E2M1_VALUES, dequantize_mxfp4

MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]:
    each block's scale the smallest power of two that brings its largest
    magnitude within 6, each value the nearest FP4 code (low nibble first)."""
    values = weight.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = values.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    grid = torch.tensor(FP4_E2M1_VALUES)
    codes = (torch.ldexp(values, -exponent.int()).unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def to_mxfp4_checkpoint(float_dir: Path, path: Path) -> Path:
    """float_dir's checkpoint with its expert matrices as MXFP4 (biases stay float)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(float_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # transformers' [E, in, out] -> the checkpoint's [E, out, in], blocks along `in`
        blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return path


def with_config(src: Path, path: Path, **changes: Any) -> Path:
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss-float") / "model")


@pytest.fixture(scope="module")
def checkpoint(float_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_mxfp4_checkpoint(float_checkpoint, tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model")


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    """transformers' model of the MXFP4 files, dequantized by transformers."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    )
    model.generation_config.eos_token_id = None
    return model.eval()


def test_dequantize_mxfp4_is_transformers_bit_for_bit() -> None:
    """Every code in both nibbles, every finite scale (subnormal and
    overflowing products included), against transformers' function."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 6, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 6), generator=gen, dtype=torch.uint8)
    scales[0, 0, :4] = torch.tensor([0, 1, 127, 254], dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours.transpose(1, 2).contiguous().view(torch.int32), expected.view(torch.int32))
    # The first block: scale 2^-127, codes low nibble first.
    first = blocks[0, 0, 0, 0]
    lo, hi = FP4_E2M1_VALUES[int(first) & 15], FP4_E2M1_VALUES[int(first) >> 4]
    assert ours[0, 0, :2].tolist() == [lo * 2.0**-127, hi * 2.0**-127]


def test_dequantize_mxfp4_refuses_nan_scales_and_misshaped_blocks() -> None:
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="NaN in the E8M0 format"):
        dequantize_mxfp4(blocks, torch.full((2, 3), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need scales"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), torch.zeros(2, 3, dtype=torch.uint8))


def test_encoder_round_trips_through_the_dequantization() -> None:
    """The test's encoder is the format's: FP4 values times powers of two
    encode exactly, others land on a neighbouring grid point."""
    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor(FP4_E2M1_VALUES)
    block_scales = 2.0 ** torch.randint(-8, 8, (5, 2), generator=gen).float()
    exact = grid[torch.randint(0, 16, (5, 64), generator=gen)] * block_scales.repeat_interleave(32, -1)
    exact[:, ::32] = 6.0 * block_scales  # each block's largest magnitude on the top code
    assert torch.equal(dequantize_mxfp4(*encode_mxfp4(exact)), exact)
    weight = torch.randn(5, 64, generator=gen)
    assert (dequantize_mxfp4(*encode_mxfp4(weight)) - weight).abs().max() <= weight.abs().max() / 6


def test_mxfp4_checkpoint_matches_hf_logits_and_greedy_tokens(checkpoint: Path, hf_model: Any,
                                                              float_checkpoint: Path) -> None:
    runner = run_paged_batches(checkpoint)
    assert max_logit_error(runner, hf_model) < 1e-4
    for r, tokens in enumerate(runner.tokens):
        prompt_len = runner.prompt_lens[r]
        with torch.no_grad():
            expected = hf_model(torch.tensor([tokens[:-1]])).logits[0]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()
    # Guards the comparison: FP4 moved the weights, so the float checkpoint's logits differ.
    assert max_logit_error(run_paged_batches(float_checkpoint), hf_model) > 1e-2


def test_strict_loader_expects_blocks_and_scales(checkpoint: Path, float_checkpoint: Path,
                                                 tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    def load(path: Path) -> Any:
        return load_model(path, model_cls=GptOssForCausalLM, attn_backend=TorchNativeBackend,
                          dtype=torch.float32, device="cpu")

    no_scales = tmp_path / "no-scales"
    shutil.copytree(checkpoint, no_scales)
    tensors = load_file(str(no_scales / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(no_scales / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing weights \(1\): model.layers.1.mlp.experts.down_proj_scales$"):
        load(no_scales)
    # Float expert tensors under an mxfp4 config: its blocks and scales missing, the float ones unexpected.
    mislabelled = with_config(float_checkpoint, tmp_path / "float-as-mxfp4", quantization_config=MXFP4_CONFIG)
    with pytest.raises(ModelLoadError) as info:
        load(mislabelled)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in info.value.missing
    assert "model.layers.0.mlp.experts.down_proj_scales" in info.value.missing
    assert "model.layers.0.mlp.experts.gate_up_proj" in info.value.unexpected


def test_other_quant_methods_are_refused_by_name(float_checkpoint: Path, tmp_path: Path) -> None:
    """GPT-OSS reads mxfp4 and nothing else (other models: test_loader.py)."""
    fp8 = with_config(float_checkpoint, tmp_path / "gpt-oss-fp8", quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ModelLoadError, match=r"quant_method='fp8' is not supported by GptOssForCausalLM; "
                                             r"supported: mxfp4"):
        load_model(fp8, model_cls=GptOssForCausalLM, attn_backend=TorchNativeBackend,
                   dtype=torch.float32, device="cpu")


@pytest.mark.slow
def test_engine_serves_the_mxfp4_checkpoint_with_hf_greedy_tokens(checkpoint: Path, hf_model: Any) -> None:
    from pagedllm import LLM, SamplingParams

    rng = random.Random(5)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(8, vocab) for _ in range(n)] for n in (4, 11, 23)]
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_generate(hf_model, prompt, 10)
