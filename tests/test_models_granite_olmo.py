"""Granite and OLMo 2 against transformers (float32), every mechanism active.

Checkpoints are random with every weight perturbed (helpers.perturbed_models:
norm weights away from 1). Granite's four multipliers are far from their
neutral values, and a test shows each one moves the logits far past the
tolerance. OLMo 2's post-norms and full-width q/k norms have no neutral
setting: any other placement or grouping gives other logits.

- Paged batches (three prefills together, decodes, a prompt prefilled in two
  chunks beside decodes) give transformers' logits for every position.
- Through the engine (LLM, float32): greedy tokens equal transformers'
  `generate` (and their logprobs its log-softmax) with a prefix-cache hit, chunked prefill mixed with decodes and
  preemption under a small KV pool, all in one run; OLMo 2 the same at -tp 2
  (mp executor); an n-gram drafter leaves Granite's greedy tokens unchanged.
Both models' -tp 2 logits against -tp 1 are in test_tp_models.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.perturbed_models import cached_perturbed_model
from test_models import PagedBatchRunner, hf_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.loader import load_hf_config, load_model
from pagedllm.model_registry.models.granite import GraniteForCausalLM
from pagedllm.model_registry.models.olmo2 import Olmo2ForCausalLM

TOKENIZER_IDS = dict(vocab_size=8192, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # the shipped tokenizer's
GRANITE = dict(embedding_multiplier=8.0, residual_multiplier=0.3, attention_multiplier=1.5, logits_scaling=5.0)
# Each multiplier's value in a model without it (head_dim 16: attention scale 16 ** -0.5).
GRANITE_NEUTRAL = dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0)
MODELS: dict[str, tuple[type[Any], dict[str, Any]]] = {
    # initializer_range 0.1: scores large enough that the attention scale shows in the logits
    "granite": (GraniteForCausalLM, {**GRANITE, "initializer_range": 0.1}),
    "olmo2": (Olmo2ForCausalLM, {}),
}


def model_path(arch: str) -> Path:
    return cached_perturbed_model(arch, seed=5, **TOKENIZER_IDS, **MODELS[arch][1])


def load(arch: str, hf_config: Any = None) -> Any:
    return load_model(model_path(arch), model_cls=MODELS[arch][0], attn_backend=TorchNativeBackend,
                      dtype=torch.float32, device="cpu", hf_config=hf_config)


def run_paged_batches(model: Any) -> PagedBatchRunner:
    """tests/test_models.py's schedule: prefills together, decodes, a chunked prompt beside decodes."""
    gen = torch.Generator().manual_seed(1)
    runner = PagedBatchRunner(model)
    for length in (5, 13, 21):
        runner.add_request(torch.randint(8, 8192, (length,), generator=gen).tolist())
    runner.step([(0, 5), (1, 13), (2, 21)])
    for _ in range(2):
        runner.step([(0, 1), (1, 1), (2, 1)])
    late = runner.add_request(torch.randint(8, 8192, (19,), generator=gen).tolist())
    runner.step([(0, 1), (late, 8), (1, 1), (2, 1)])
    runner.step([(0, 1), (1, 1), (late, 11), (2, 1)])  # the second chunk reads 8 cached tokens
    runner.step([(0, 1), (1, 1), (2, 1), (late, 1)])
    return runner


def hf_logits(arch: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(model_path(arch))(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", list(MODELS))
def test_paged_batches_match_hf_logits_and_greedy_tokens(arch: str) -> None:
    runner = run_paged_batches(load(arch))
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        expected = hf_logits(arch, tokens[:num_computed])
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        torch.testing.assert_close(ours, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4)
        prompt_len = runner.prompt_lens[r]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("multiplier", list(GRANITE_NEUTRAL))
def test_each_granite_multiplier_moves_the_logits_past_the_tolerance(multiplier: str) -> None:
    """Our model told the neutral value of one multiplier is far from
    transformers' with the checkpoint's: the comparisons above see each one."""
    hf_config = load_hf_config(model_path("granite"))
    setattr(hf_config, multiplier, GRANITE_NEUTRAL[multiplier])
    runner = PagedBatchRunner(load("granite", hf_config))
    prompt = torch.randint(8, 8192, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    runner.add_request(prompt)
    runner.step([(0, len(prompt))])
    expected = hf_logits("granite", prompt)
    ours = torch.stack([runner.logits[0][pos] for pos in range(len(prompt))])
    assert (ours - expected).abs().max() > 1000 * 1e-5 * expected.abs().max()


# ------------------------------------------------------------------ the engine

NUM_NEW_TOKENS = 16
BUDGET = 32  # max_num_batched_tokens: the 41- and 50-token prompts prefill in chunks


def _prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(8, 8192) for _ in range(n)] for n in lengths]


def hf_generate(arch: str, prompt: list[int]) -> list[int]:
    model = hf_model(model_path(arch))
    output = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=2,
    )
    return output[0, len(prompt) :].tolist()


def _greedy() -> SamplingParams:
    # logprobs: the sampled token's, which see Granite's logits_scaling where the argmax does not.
    return SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=0)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)


def _count_mixed_steps(llm: LLM) -> list[int]:
    """Counts steps that schedule a prefill chunk beside decodes (a one-element list)."""
    scheduler = llm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    schedule, mixed = scheduler.schedule, [0]

    def recording_schedule() -> Any:
        output = schedule()
        kinds = set()
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            computed_before = request.num_computed_tokens - num_tokens  # schedule() already advanced it
            kinds.add("decode" if computed_before >= request.num_prompt_tokens else "prefill")
        mixed[0] += kinds == {"decode", "prefill"}
        return output

    scheduler.schedule = recording_schedule
    return mixed


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


def _assert_engine_matches_hf(arch: str, llm: LLM) -> None:
    """Greedy tokens and their logprobs equal transformers', with a prefix
    hit, prefill chunks beside decodes and preemptions on the way."""
    mixed_steps = _count_mixed_steps(llm)
    prefix = _prompts([48], seed=7)[0]  # exactly 3 blocks
    first = [prefix + _prompts([4], seed=8)[0]]
    # The prefix-sharing prompts first: admitted while the first batch's blocks are still cached.
    second = _prompts([6, 9], seed=9, prefix=prefix) + _prompts([20, 27, 33, 41, 50], seed=10)
    for prompts in (first, second):
        outputs = _generate(llm, prompts)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_generate(arch, p) for p in prompts]
    for prompt, output in zip(second, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        expected = torch.log_softmax(hf_logits(arch, prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
        got = [entry[token].logprob for token, entry in zip(tokens, output.outputs[0].logprobs, strict=True)]
        torch.testing.assert_close(torch.tensor(got), expected[range(len(tokens)), tokens], atol=1e-4, rtol=0)
    assert all(output.num_cached_tokens >= 48 for output in outputs[:2])
    assert llm.engine_core.engine_core.scheduler.num_preemptions > 0  # type: ignore[attr-defined]
    assert mixed_steps[0] > 0


def _llm(arch: str, **kwargs: Any) -> LLM:
    # 16 blocks of 16 tokens: the second batch needs about 26, so requests are preempted and recomputed.
    return LLM(model=str(model_path(arch)), dtype="float32", num_kv_blocks=16, max_num_batched_tokens=BUDGET,
               max_model_len=256, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_engine_greedy_matches_hf_with_prefix_hits_chunks_and_preemption(arch: str) -> None:
    _assert_engine_matches_hf(arch, _llm(arch))


@pytest.mark.slow
def test_olmo2_at_tp2_mp_matches_hf_with_prefix_hits_chunks_and_preemption() -> None:
    """Two ranks (mp executor), one KV head each: q/k norms across ranks."""
    llm = _llm("olmo2", tensor_parallel_size=2)
    try:
        ready = llm.engine_core.ready  # type: ignore[attr-defined]
        assert (ready.executor, ready.world_size) == ("mp", 2)
        _assert_engine_matches_hf("olmo2", llm)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_ngram_drafts_leave_granite_greedy_tokens_unchanged() -> None:
    from pagedllm.testing.suites.drafter import repeated_span_prompts

    prompts = repeated_span_prompts(4, seed=0)
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(model=str(model_path("granite")), dtype="float32", num_kv_blocks=64, speculative_config=speculative)
    tokens = [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)]
    assert tokens == [hf_generate("granite", p) for p in prompts]
    plain = LLM(model=str(model_path("granite")), dtype="float32", num_kv_blocks=64)
    assert tokens == [list(o.outputs[0].token_ids) for o in _generate(plain, prompts)]
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats  # type: ignore[attr-defined]
    assert stats.num_draft_tokens > 0
