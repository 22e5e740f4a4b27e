"""Gemma 2 and Gemma 3 (text) over the paged KV cache against HF transformers (float32).

Every Gemma mechanism is active in the checkpoints the tests build: a
sliding window (6) shorter than the prompts, attention soft-cap (Gemma 2) and
final-logit soft-cap small enough to clip (weights drawn at 5x the default
scale, so scores and logits reach them), query_pre_attn_scalar != head_dim,
norm weights away from 0 (so (1 + w) is not 1), and for Gemma 3 five sliding
layers per global one with a local RoPE base (10) far from the global one
(1e6, linear scaling 8). `test_each_mechanism_is_exercised` shows each one
matters: switched off in our model alone, the logits leave HF's. Through
the engine, greedy tokens equal transformers' `generate` with chunked
prefill, prefix-cache hits, preemption and ngram drafts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from test_models import PagedBatchRunner, hf_model

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.gemma2 import Gemma2ForCausalLM
from pagedllm.model_registry.models.gemma3 import Gemma3ForCausalLM

MODEL_CLASSES = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}
# Shared by every scenario: scores and logits large enough for the caps to clip.
ACTIVE = dict(initializer_range=0.1, query_pre_attn_scalar=24, sliding_window=6)
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
}
SCENARIOS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer_types: sliding, full (transformers' default alternation)
    "gemma2": ("gemma2", {**ACTIVE, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0}),
    "gemma2-untied-erf-gelu": ("gemma2", {
        **ACTIVE, "attn_logit_softcapping": 1.0, "final_logit_softcapping": None, "tie_word_embeddings": False,
        "hidden_activation": "gelu",
    }),
    # six layers: transformers' default 5:1 pattern, the last one global. An
    # attention cap in the config is ignored, as transformers' Gemma 3 does.
    "gemma3": ("gemma3", {
        **ACTIVE, "num_hidden_layers": 6, "final_logit_softcapping": 3.0, "rope_parameters": GEMMA3_ROPE,
        "attn_logit_softcapping": 1.0,
    }),
}
NORM_NOISE = 0.5


def checkpoint(scenario: str, **extra: Any) -> Any:
    arch, overrides = SCENARIOS[scenario]
    return cached_tiny_model(arch, norm_noise=NORM_NOISE, **overrides, **extra)


def load(scenario: str, dtype: torch.dtype = torch.float32) -> Any:
    model_cls = MODEL_CLASSES[SCENARIOS[scenario][0]]
    return load_model(checkpoint(scenario), model_cls=model_cls, attn_backend=TorchNativeBackend, dtype=dtype,
                      device="cpu")


def run_batches(model: Any) -> PagedBatchRunner:
    """test_models' schedule: three prefills in one batch, decodes, and a
    fourth prompt prefilled in two chunks beside them."""
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    runner = PagedBatchRunner(model)
    for length in (5, 13, 21):
        runner.add_request(torch.randint(vocab, (length,), generator=gen).tolist())
    runner.step([(0, 5), (1, 13), (2, 21)])
    for _ in range(2):
        runner.step([(0, 1), (1, 1), (2, 1)])
    late = runner.add_request(torch.randint(vocab, (19,), generator=gen).tolist())
    runner.step([(0, 1), (late, 8), (1, 1), (2, 1)])
    runner.step([(0, 1), (1, 1), (late, 11), (2, 1)])  # the second chunk reads 8 cached tokens
    runner.step([(0, 1), (1, 1), (2, 1), (late, 1)])
    return runner


def hf_logits(scenario: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(checkpoint(scenario))(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_batches_match_hf_logits_and_greedy_tokens(scenario: str) -> None:
    runner = run_batches(load(scenario))
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        expected = hf_logits(scenario, tokens[:num_computed])
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        prompt_len = runner.prompt_lens[r]
        assert num_computed > prompt_len
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


def _no_attn_soft_cap(model: Any) -> None:
    for attn in model.get_attention_layers():
        attn.impl.logits_soft_cap = None


def _no_final_soft_cap(model: Any) -> None:
    model.logits_head.soft_cap = None


def _no_sliding_window(model: Any) -> None:
    for attn in model.get_attention_layers():
        attn.impl.sliding_window = None


def _head_dim_scale(model: Any) -> None:
    for attn in model.get_attention_layers():
        attn.impl.scale = attn.head_size**-0.5


def _unscaled_embeddings(model: Any) -> None:
    model.model.normalizer.fill_(1.0)


def _global_rope_everywhere(model: Any) -> None:
    model.model.rotary_emb["sliding_attention"] = model.model.rotary_emb["full_attention"]


def _no_qk_norm(model: Any) -> None:
    for layer in model.model.layers:
        layer.self_attn.qk_norm = False


def _norm_weight_as_is(model: Any) -> None:  # w instead of 1 + w
    for module in model.modules():
        if type(module).__name__ == "GemmaRMSNorm":
            module.weight.sub_(1.0)  # (1 + (w - 1)) = w


ABLATIONS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "attn-soft-cap": ("gemma2", _no_attn_soft_cap),
    "final-soft-cap": ("gemma2", _no_final_soft_cap),
    "gemma3-final-soft-cap": ("gemma3", _no_final_soft_cap),
    "sliding-window": ("gemma2", _no_sliding_window),
    "gemma3-sliding-window": ("gemma3", _no_sliding_window),
    "query-pre-attn-scalar": ("gemma2", _head_dim_scale),
    "embedding-normalizer": ("gemma2", _unscaled_embeddings),
    "one-plus-w-norm": ("gemma2", _norm_weight_as_is),
    "local-rope-base": ("gemma3", _global_rope_everywhere),
    "qk-norm": ("gemma3", _no_qk_norm),
}


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_each_mechanism_is_exercised(ablation: str) -> None:
    """Guards the scenarios above against silently testing less: one
    mechanism switched off in our model alone moves a 21-token prompt's
    logits far outside the tolerance the HF comparison allows."""
    scenario, switch_off = ABLATIONS[ablation]
    model = load(scenario)
    with torch.no_grad():
        switch_off(model)
    runner = PagedBatchRunner(model)
    prompt = torch.randint(model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.add_request(prompt)
    runner.step([(0, 21)])
    ours = torch.stack([runner.logits[0][pos] for pos in range(21)])
    assert (ours - hf_logits(scenario, prompt)).abs().max() > 1e-2


def test_gemma_defaults_tie_embeddings_and_read_the_per_layer_config() -> None:
    model = load("gemma3")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    windows = [attn.sliding_window for attn in model.get_attention_layers()]
    assert windows == [6, 6, 6, 6, 6, None]  # five sliding layers per global one
    assert [attn.impl.logits_soft_cap for attn in model.get_attention_layers()] == [None] * 6
    assert model.logits_head.soft_cap == 3.0
    assert sorted(model.model.rotary_emb) == ["full_attention", "sliding_attention"]
    gemma2 = load("gemma2")
    assert [attn.impl.logits_soft_cap for attn in gemma2.get_attention_layers()] == [1.0, 1.0]
    assert [attn.impl.scale for attn in gemma2.get_attention_layers()] == [24**-0.5] * 2
    untied = load("gemma2-untied-erf-gelu")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_gemma_norm_matches_transformers_in_bfloat16_bit_for_bit() -> None:
    """(1 + w) taken in float32 and cast once: storing 1 + w in bfloat16
    (or casting before multiplying, as Llama's RMSNorm does) rounds differently."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from pagedllm.model_registry.layers.norm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    ours, reference = GemmaRMSNorm(64, eps=1e-6), Gemma2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=gen) * 0.5)
        ours.weight.copy_(reference.weight)
    ours, reference = ours.to(torch.bfloat16), reference.to(torch.bfloat16)
    assert torch.equal(ours(x), reference(x))
    out, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(out, reference(x + residual))


def test_gemma3_released_config_layout_gives_transformers_rope_tables(tmp_path: Path) -> None:
    """A config.json as Gemma 3 ships it (rope_theta, rope_local_base_freq,
    rope_scaling linear 8, sliding_window_pattern 6): each layer type's
    cos/sin equal transformers' to the bit, and the pattern places the
    global layers."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from pagedllm.model_registry.loader import load_hf_config
    from pagedllm.testing.checkpoints import TINY_SIZES

    config = {
        **TINY_SIZES, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64,
        "num_hidden_layers": 7, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512, "sliding_window_pattern": 6,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = load_hf_config(tmp_path)
    model = Gemma3ForCausalLM(hf_config, TorchNativeBackend)
    assert [attn.sliding_window for attn in model.get_attention_layers()] == [512] * 5 + [None, 512]
    reference, positions = Gemma3RotaryEmbedding(hf_config), torch.arange(300)
    for layer_type in ("sliding_attention", "full_attention"):
        expected = reference(torch.zeros(1), positions[None], layer_type)
        ours = model.model.rotary_emb[layer_type](positions)
        assert all(torch.equal(a, b[0]) for a, b in zip(ours, expected, strict=True)), layer_type
    local, global_ = (model.model.rotary_emb[t].cos_cache for t in ("sliding_attention", "full_attention"))
    assert not torch.allclose(local, global_)


@pytest.mark.parametrize(("key", "value"), [("use_bidirectional_attention", True), ("hidden_activation", "silu")])
def test_unsupported_gemma_config_is_a_config_error(key: str, value: Any) -> None:
    from transformers import Gemma2Config

    from pagedllm.testing.checkpoints import TINY_SIZES

    config = Gemma2Config(**TINY_SIZES, vocab_size=64)
    setattr(config, key, value)
    with pytest.raises(ConfigError, match=key):
        Gemma2ForCausalLM(config, TorchNativeBackend)


# ------------------------------------------------------------ the engine

ENGINE_SCENARIOS = {
    # windows of 20 over 16-token blocks; the shipped tokenizer's vocabulary
    "gemma2": ("gemma2", {**ACTIVE, "sliding_window": 20, "attn_logit_softcapping": 1.0,
                          "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3", {**ACTIVE, "sliding_window": 20, "num_hidden_layers": 6, "final_logit_softcapping": 3.0,
                          "rope_parameters": GEMMA3_ROPE}),
}
BUDGET = 32  # max_num_batched_tokens: every prompt below is longer, so it is prefilled in chunks
NUM_NEW_TOKENS = 12


def _engine_checkpoint(scenario: str) -> Path:
    arch, overrides = ENGINE_SCENARIOS[scenario]
    return cached_tiny_model(arch, with_tokenizer=True, seed=7, norm_noise=NORM_NOISE, **overrides)


def _assert_greedy_matches_hf(path: Path, prompts: list[list[int]], outputs: list[Any]) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected


def _generate(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(ENGINE_SCENARIOS))
def test_engine_greedy_matches_hf_generate_with_chunks_and_prefix_hits(
    scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")  # the block invariant after every step
    path = _engine_checkpoint(scenario)
    rng = random.Random(3)
    prefix = [rng.randrange(8, 8192) for _ in range(48)]  # three 16-token blocks
    first, second = ([prefix + [rng.randrange(8, 8192) for _ in range(n)] for n in lengths]
                     for lengths in ((3, 11), (6, 9, 14)))
    assert all(len(prompt) > BUDGET for prompt in first + second)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    _assert_greedy_matches_hf(path, first, _generate(llm, first))
    outputs = _generate(llm, second)
    _assert_greedy_matches_hf(path, second, outputs)
    assert all(output.num_cached_tokens >= len(prefix) for output in outputs)  # the first batch cached it


@pytest.mark.slow
def test_engine_preempts_and_recomputes_gemma3_to_hf_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    path = _engine_checkpoint("gemma3")
    rng = random.Random(4)
    prompts = [[rng.randrange(8, 8192) for _ in range(40)] for _ in range(4)]
    # Six KV cache groups (five sliding layers, one global) share the pool:
    # 56 blocks hold one 128-token request's groups but not all four
    # requests' 40-token prompts and outputs at once.
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=56, max_model_len=128)
    _assert_greedy_matches_hf(path, prompts, _generate(llm, prompts))
    assert llm.engine_core.engine_core.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_engine_ngram_drafts_verified_by_gemma2_keep_hf_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification steps score 1 + k tokens per request: the decode path
    with several queries per request, soft-capped and windowed."""
    from pagedllm import LLM

    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    path = _engine_checkpoint("gemma2")
    rng = random.Random(5)
    motif = [rng.randrange(8, 8192) for _ in range(6)]
    prompts = [motif * 5, [rng.randrange(8, 8192) for _ in range(10)] + motif * 3]  # repeats the drafter finds
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "policy": "always"}
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32, speculative_config=speculative)
    _assert_greedy_matches_hf(path, prompts, _generate(llm, prompts))
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
