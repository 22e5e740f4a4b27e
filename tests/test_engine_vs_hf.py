"""End to end: greedy tokens of the whole engine equal HF transformers' (float32).

For each architecture: (a) a batch of 8 prompts of different lengths,
(b) the same under a 32-token budget (chunked prefill mixed with decodes),
(c) a second batch sharing a 3-block prefix (prefix-cache hits), and
(d) a KV pool so small that requests are preempted and recomputed.
The block invariant is checked after every step in all four.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams

NUM_NEW_TOKENS = 64
PROMPT_LENS = [5, 9, 14, 20, 27, 33, 41, 50]
ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


def _model_path(arch: str):
    return cached_tiny_model(arch, with_tokenizer=True, seed=1234)


def _random_prompts(lengths: list[int], seed: int, vocab_size: int = 8192, prefix: list[int] | None = None):
    rng = random.Random(seed)
    # Skip the special tokens (ids < 8) so no prompt contains EOS.
    return [(prefix or []) + [rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]


_hf_cache: dict[tuple, list[int]] = {}


def hf_greedy(arch: str, prompt: list[int], num_new_tokens: int = NUM_NEW_TOKENS) -> list[int]:
    """Reference: HF transformers, one prompt at a time, KV cache, float32."""
    key = (arch, tuple(prompt), num_new_tokens)
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = _hf_model(arch)
        output = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        _hf_cache[key] = output[0, len(prompt) :].tolist()
        del AutoModelForCausalLM
    return _hf_cache[key]


_hf_models: dict[str, torch.nn.Module] = {}


def _hf_model(arch: str) -> torch.nn.Module:
    if arch not in _hf_models:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(_model_path(arch)), dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _hf_models[arch] = model.eval()
    return _hf_models[arch]


def _greedy(max_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)


def _assert_matches_hf(arch: str, prompts: list[list[int]], outputs: list) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert list(output.outputs[0].token_ids) == hf_greedy(arch, prompt)
        assert output.outputs[0].finish_reason == "length"


def _engine(llm: LLM):
    return llm.engine_core.engine_core


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_prompts_matches_hf(arch: str) -> None:
    prompts = _random_prompts(PROMPT_LENS, seed=1)
    llm = LLM(model=str(_model_path(arch)), dtype="float32", num_kv_blocks=256)
    outputs = _generate(llm, prompts)
    _assert_matches_hf(arch, prompts, outputs)
    core = _engine(llm)
    assert core.kv_cache_manager.num_free_blocks == 256  # everything freed at the end
    core.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_mixed_with_decodes_matches_hf(arch: str) -> None:
    prompts = _random_prompts(PROMPT_LENS, seed=1)
    llm = LLM(model=str(_model_path(arch)), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    scheduler = _engine(llm).scheduler
    schedule = scheduler.schedule
    mixed_steps = 0

    def recording_schedule():
        nonlocal mixed_steps
        scheduler_output = schedule()
        assert scheduler_output.total_num_scheduled_tokens <= 32
        kinds = set()
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            # schedule() already advanced num_computed_tokens by this step's tokens.
            computed_before = request.num_computed_tokens - num_tokens
            kinds.add("decode" if computed_before >= request.num_prompt_tokens else "prefill")
        mixed_steps += kinds == {"decode", "prefill"}
        return scheduler_output

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    outputs = _generate(llm, prompts)
    _assert_matches_hf(arch, prompts, outputs)
    assert mixed_steps > 0, "the budget never mixed a prefill chunk with decodes"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_second_batch_hits_cache_and_matches_hf(arch: str) -> None:
    prefix = _random_prompts([48], seed=7)[0]  # exactly 3 blocks of 16
    first = _random_prompts([6, 10, 3, 12], seed=2, prefix=prefix)
    second = _random_prompts([5, 9, 14, 2], seed=3, prefix=prefix)
    llm = LLM(model=str(_model_path(arch)), dtype="float32", num_kv_blocks=256)
    _assert_matches_hf(arch, first, _generate(llm, first))
    outputs = _generate(llm, second)
    _assert_matches_hf(arch, second, outputs)
    for output in outputs:
        assert output.num_cached_tokens >= 48


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_a_tiny_kv_pool_matches_hf(arch: str) -> None:
    prompts = _random_prompts(PROMPT_LENS, seed=1)
    # 8 requests need up to 8 blocks each at the end; 24 blocks force recompute.
    llm = LLM(model=str(_model_path(arch)), dtype="float32", num_kv_blocks=24, max_model_len=256)
    outputs = _generate(llm, prompts)
    _assert_matches_hf(arch, prompts, outputs)
    assert _engine(llm).scheduler.num_preemptions > 0
