"""Scaled RoPE tables (yarn, longrope, dynamic NTK, partial rotary) against
transformers' own rotary embedding classes (float32), row for row."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    get_rope_parameters,
    rope_position_limit,
)

HEAD_DIM = 16
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM)
# 8 = HEAD_DIM / 2 factors, far enough from 1 that short and long tables differ.
SHORT_FACTOR = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
LONG_FACTOR = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]


def llama_config(max_position: int, rope_parameters: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SIZES, max_position_embeddings=max_position, rope_parameters=dict(rope_parameters))


def phi3_config(max_position: int, partial_rotary_factor: float = 1.0) -> Any:
    from transformers import Phi3Config

    num_factors = int(HEAD_DIM * partial_rotary_factor) // 2
    rope = dict(rope_type="longrope", short_factor=SHORT_FACTOR[:num_factors], long_factor=LONG_FACTOR[:num_factors])
    sizes = {key: value for key, value in SIZES.items() if key != "head_dim"}
    return Phi3Config(**sizes, max_position_embeddings=max_position, original_max_position_embeddings=16,
                      partial_rotary_factor=partial_rotary_factor, rope_parameters=rope)


def hf_cos_sin(rotary_emb: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin [len(positions), rotary_dim] for one forward over `positions`."""
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary_emb(x, positions[None, :])
    return cos[0], sin[0]


def ours(config: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(HEAD_DIM, config.max_position_embeddings, get_rope_parameters(config))
    return rotary(positions)


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
YARN_CASES = {
    "yarn": YARN,
    "yarn-beta-no-truncate": {**YARN, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False},
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 1.25},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_table_matches_transformers(case: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(64, YARN_CASES[case])
    positions = torch.arange(64)
    cos, sin = ours(config, positions)
    hf_cos, hf_sin = hf_cos_sin(LlamaRotaryEmbedding(config), positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=1e-6)
    # The scaling is really on: neither the default frequencies nor a unit attention factor.
    default_cos, _ = ours(llama_config(64, {"rope_type": "default", "rope_theta": 10000.0}), positions)
    assert not torch.allclose(cos, default_cos, atol=1e-3)


def test_longrope_long_factors_past_the_original_length_match_transformers() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi3_config(64)  # a long-context model: 64 > original 16, the table uses the long factors
    positions = torch.arange(40)  # one transformers forward past 16: its long factors
    cos, sin = ours(config, positions)
    hf_cos, hf_sin = hf_cos_sin(Phi3RotaryEmbedding(config), positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=1e-6)
    assert cos[0, 0] > 1.0  # the attention factor sqrt(1 + ln 4 / ln 16) scales cos


def test_longrope_short_factors_within_the_original_length_match_transformers() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi3_config(16)  # max_position_embeddings == original: the short factors
    positions = torch.arange(16)
    cos, sin = ours(config, positions)
    hf_cos, hf_sin = hf_cos_sin(Phi3RotaryEmbedding(config), positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=1e-6)
    long_cos, _ = ours(phi3_config(64), positions)
    assert not torch.allclose(cos, long_cos, atol=1e-3)  # the two sets really differ


def test_legacy_su_reads_as_longrope() -> None:
    config = phi3_config(64)
    legacy = type("Cfg", (), {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
                              "rope_scaling": {**config.rope_parameters, "type": "su", "rope_type": "su"}})()
    params = get_rope_parameters(legacy)
    assert params["rope_type"] == "longrope"
    torch.testing.assert_close(
        RotaryEmbedding(HEAD_DIM, 64, params)(torch.arange(20))[0], ours(config, torch.arange(20))[0]
    )


def test_partial_rotary_table_and_rotation_match_transformers() -> None:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = phi3_config(64, partial_rotary_factor=0.5)
    positions = torch.arange(30)
    cos, sin = ours(config, positions)
    assert cos.shape == (30, HEAD_DIM // 2)
    hf_cos, hf_sin = hf_cos_sin(Phi3RotaryEmbedding(config), positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=1e-6)
    x = torch.randn(30, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    # transformers' layout: [batch, heads, T, head_dim]
    hf_x = x.transpose(0, 1)[None]
    expected, _ = apply_rotary_pos_emb(hf_x, hf_x, hf_cos[None], hf_sin[None])
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin), expected[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.equal(apply_rotary_emb(x, cos, sin)[..., HEAD_DIM // 2 :], x[..., HEAD_DIM // 2 :])


def test_dynamic_ntk_rows_match_transformers_generate() -> None:
    """transformers' generate: a prompt within max_position_embeddings, then
    one token per forward; each new position's row is computed with the base
    for that sequence length, and the cached ones keep theirs."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(16, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0})
    assert rope_position_limit(config) == 48
    hf_rotary = LlamaRotaryEmbedding(config)
    prompt_len, total = 10, 48
    rows = [hf_cos_sin(hf_rotary, torch.arange(prompt_len))]
    rows += [hf_cos_sin(hf_rotary, torch.tensor([pos])) for pos in range(prompt_len, total)]
    hf_cos, hf_sin = torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])
    cos, sin = ours(config, torch.arange(total))
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=1e-6)
    default_cos, _ = ours(llama_config(48, {"rope_type": "default", "rope_theta": 10000.0}), torch.arange(total))
    torch.testing.assert_close(cos[:16], default_cos[:16])  # unscaled within max_position_embeddings
    assert not torch.allclose(cos[16:], default_cos[16:], atol=1e-3)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"rope_type": "ntk-by-parts", "rope_theta": 1e4}, "rope_parameters.rope_type"),
        ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_parameters.original_max_position_embeddings"),
        ({"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
          "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "rope_parameters.long_factor"),
        ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1},
         "rope_parameters.partial_rotary_factor"),
    ],
)
def test_unsupported_rope_parameters_name_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        RotaryEmbedding(HEAD_DIM, 64, params)
    assert err.value.key == field


@pytest.mark.slow
def test_dynamic_ntk_engine_decodes_past_max_position_embeddings_like_transformers_generate() -> None:
    """The engine serves max_position_embeddings * factor positions; a prompt
    within max_position_embeddings decodes past it with transformers'
    per-length bases (a prefill of 8 + decode to 48 with 16 * 3 positions)."""
    from helpers.tiny_models import cached_tiny_model
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}
    path = cached_tiny_model("llama", with_tokenizer=True, seed=3, max_position_embeddings=16, rope_parameters=rope)
    prompts = [[101, 2045, 77, 3000, 12, 9, 4400, 18], [55, 66, 77, 88, 99]]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16)
    assert llm.engine_core.engine_core.scheduler.max_model_len == 48
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        # A fresh model per prompt: transformers keeps a grown base between calls.
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = list(output.outputs[0].token_ids)
        assert tokens == expected.sequences[0, len(prompt):].tolist()
        # The sampled tokens' logprobs too: greedy tokens alone barely move with the base.
        hf_logprobs = [torch.log_softmax(logits[0], -1)[t].item() for logits, t in zip(expected.logits, tokens,
                                                                                       strict=True)]
        ours = [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens, strict=True)]
        assert ours == pytest.approx(hf_logprobs, abs=1e-4)
