"""Phi-3 (fused qkv / gate_up checkpoints, LongRoPE, partial rotary) against
HF transformers in float32: paged batches row for row, then greedy tokens of
the whole engine against `generate` with a prefix-cache hit and chunked
prefill.

Two checkpoints, one per LongRoPE regime (layers/rotary.py's docstring):
a long-context model (max_position_embeddings 64 > original 16: the long
factors) whose prompts all start past the original length, and a
short-context one (max_position_embeddings == original: the short factors).
In both, transformers picks the same factors for every sequence tested.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from test_models import PagedBatchRunner, hf_model

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.phi3 import Phi3ForCausalLM

ORIGINAL_LENGTH = 16
PARTIAL_ROTARY_FACTOR = 0.75  # Phi-4-mini's: 12 of each head's 16 dims rotate
NUM_FACTORS = int(16 * PARTIAL_ROTARY_FACTOR) // 2


def phi3_overrides(max_position: int) -> dict[str, Any]:
    rope = dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.4 * i for i in range(NUM_FACTORS)],
        long_factor=[1.0 + 3.0 * i for i in range(NUM_FACTORS)],
    )
    # pad_token_id: Phi3Config's default (32000) is outside a tiny vocabulary.
    return dict(
        pad_token_id=0, max_position_embeddings=max_position, original_max_position_embeddings=ORIGINAL_LENGTH,
        partial_rotary_factor=PARTIAL_ROTARY_FACTOR, rope_parameters=rope,
    )


LONG_CONTEXT = phi3_overrides(64)
SHORT_CONTEXT = phi3_overrides(ORIGINAL_LENGTH)
# regime -> (config overrides, prompt lengths, late prompt's two chunks)
SCENARIOS: dict[str, tuple[dict[str, Any], tuple[int, ...], tuple[int, int]]] = {
    "long-factors": (LONG_CONTEXT, (17, 20, 25), (8, 16)),
    # Phi-4-mini ties its LM head to the embeddings.
    "short-factors-tied": ({**SHORT_CONTEXT, "tie_word_embeddings": True}, (3, 6, 9), (4, 5)),
    # Phi-3-mini-4k's config sets a window (2047) on every layer; here 6 < every prompt.
    "long-factors-sliding-window": ({**LONG_CONTEXT, "sliding_window": 6}, (17, 20, 25), (8, 16)),
}


def run_scenario(overrides: dict[str, Any], prompt_lens: tuple[int, ...], chunks: tuple[int, int]) -> Any:
    path = cached_tiny_model("phi3", eos_token_id=2, **overrides)
    model = load_model(path, model_cls=Phi3ForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu")
    gen = torch.Generator().manual_seed(1)
    runner = PagedBatchRunner(model)
    for length in prompt_lens:
        runner.add_request(torch.randint(model.config.vocab_size, (length,), generator=gen).tolist())
    runner.step([(r, n) for r, n in enumerate(prompt_lens)])  # fresh prefills in one batch
    for _ in range(3):
        runner.step([(0, 1), (1, 1), (2, 1)])
    late = runner.add_request(torch.randint(model.config.vocab_size, (sum(chunks),), generator=gen).tolist())
    runner.step([(0, 1), (late, chunks[0]), (1, 1), (2, 1)])  # first chunk beside decodes
    runner.step([(0, 1), (1, 1), (late, chunks[1]), (2, 1)])  # second chunk reads the cached first
    runner.step([(0, 1), (1, 1), (2, 1), (late, 1)])
    return runner, path


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_phi3_paged_batches_match_hf_logits(scenario: str) -> None:
    overrides, prompt_lens, chunks = SCENARIOS[scenario]
    runner, path = run_scenario(overrides, prompt_lens, chunks)
    reference = hf_model(path)
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        # Every sequence stays in one LongRoPE regime for transformers too.
        assert (runner.prompt_lens[r] > ORIGINAL_LENGTH) == scenario.startswith("long-factors")
        assert scenario.startswith("long-factors") or len(tokens) <= ORIGINAL_LENGTH
        with torch.no_grad():
            expected = reference(torch.tensor([tokens[:num_computed]])).logits[0]
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        prompt_len = runner.prompt_lens[r]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


def test_phi3_fused_checkpoint_tensors_are_split_into_the_stacked_layers() -> None:
    from safetensors.torch import load_file

    path = cached_tiny_model("phi3", eos_token_id=2, **LONG_CONTEXT)
    model = load_model(path, model_cls=Phi3ForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu")
    checkpoint = load_file(str(path / "model.safetensors"))
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        assert torch.equal(dict(model.named_parameters())[name], checkpoint[name])


# ------------------------------------------------------------ whole engine

NUM_NEW_TOKENS = 24


def _engine_model_path() -> Any:
    return cached_tiny_model("phi3", with_tokenizer=True, seed=1234, **phi3_overrides(128))


def _prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(8, 8192) for _ in range(n)] for n in lengths]


def _hf_generate(prompt: list[int]) -> list[int]:
    model = hf_model(_engine_model_path())
    output = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_phi3_engine_greedy_matches_hf_generate_with_prefix_hit_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    prefix = _prompts([32], seed=7)[0]  # two blocks of 16, past the original length
    first = _prompts([3, 9], seed=2, prefix=prefix)
    second = _prompts([5, 14], seed=3, prefix=prefix)
    llm = LLM(model=str(_engine_model_path()), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for batch, min_cached in ((first, 0), (second, 32)):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        for prompt, output in zip(batch, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == _hf_generate(prompt)
            assert output.num_cached_tokens >= min_cached
