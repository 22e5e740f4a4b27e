"""Every new native architecture through the whole engine, every engine
feature at once, at -tp 1 and -tp 2 (mp executor), the mixture-of-experts
ones also with --enable-expert-parallel at 2 ranks: greedy tokens equal
transformers' `generate` in float32.

One run per architecture and TP size holds a prefix-cache hit (two prompts
share the first batch's 48-token prefix), chunked prefill beside decodes
(a 32-token budget under longer prompts), preemption and recompute (a KV pool
too small for the second batch) and suffix-decoding drafts verified by the model
(suffix decoding under the `always` policy: a prompt asked again is
drafted from its first answer). The checkpoints are the
per-model test files' engine checkpoints, with each architecture's
mechanisms active (windows shorter than the prompts, soft-caps that clip,
sinks, scaled RoPE past the original length, Granite's multipliers, MoE
routing that varies token to token, Qwen2-MoE's shared expert, DeepSeek's
latent attention: its cache one latent vector per token, the same on every
rank).
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import hf_model
from test_models_deepseek import build_deepseek
from test_models_gemma import _engine_checkpoint as gemma_checkpoint
from test_models_gpt_oss import build_gpt_oss
from test_models_granite_olmo import _count_mixed_steps
from test_models_granite_olmo import model_path as granite_olmo_checkpoint
from test_models_moe import build_moe
from test_models_phi3 import _engine_model_path as phi3_checkpoint

from pagedllm import LLM, SamplingParams

NUM_NEW_TOKENS = 16
BUDGET = 32  # max_num_batched_tokens: the longer prompts prefill in chunks
PREFIX_LEN = 48  # three 16-token blocks
# Mixtral's window: shorter than the long prompts; the model test's 12 frees
# so many blocks behind it that 10 KV blocks never preempt.
MIXTRAL_WINDOW = 24


@functools.cache
def _gpt_oss_checkpoint() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="pagedllm-gpt-oss-"))
    atexit.register(shutil.rmtree, folder, True)
    return build_gpt_oss(folder / "model")


@functools.cache
def _moe_checkpoint(architecture: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="pagedllm-moe-"))
    atexit.register(shutil.rmtree, folder, True)
    return build_moe(architecture, folder / "model", window=MIXTRAL_WINDOW)


@functools.cache
def _deepseek_checkpoint(architecture: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="pagedllm-deepseek-"))
    atexit.register(shutil.rmtree, folder, True)
    return build_deepseek(architecture, folder / "model")


# architecture -> (its checkpoint, KV blocks that hold one request's groups but not the second batch at once;
# Gemma 3's six groups need more, and keep the prefix's window blocks cached until the second batch)
ARCHITECTURES: dict[str, tuple[Callable[[], Path], int]] = {
    "Phi3ForCausalLM": (phi3_checkpoint, 10),
    "Gemma2ForCausalLM": (lambda: gemma_checkpoint("gemma2"), 20),
    "Gemma3ForCausalLM": (lambda: gemma_checkpoint("gemma3"), 56),
    "GraniteForCausalLM": (lambda: granite_olmo_checkpoint("granite"), 10),
    "Olmo2ForCausalLM": (lambda: granite_olmo_checkpoint("olmo2"), 10),
    "GptOssForCausalLM": (_gpt_oss_checkpoint, 20),
    "Qwen3MoeForCausalLM": (lambda: _moe_checkpoint("Qwen3MoeForCausalLM"), 10),
    "Qwen2MoeForCausalLM": (lambda: _moe_checkpoint("Qwen2MoeForCausalLM"), 10),
    "MixtralForCausalLM": (lambda: _moe_checkpoint("MixtralForCausalLM"), 10),
    "DeepseekV2ForCausalLM": (lambda: _deepseek_checkpoint("DeepseekV2ForCausalLM"), 10),
    "DeepseekV3ForCausalLM": (lambda: _deepseek_checkpoint("DeepseekV3ForCausalLM"), 10),
}


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(11)
    prefix = [rng.randrange(8, vocab) for _ in range(PREFIX_LEN)]
    first = [prefix + [rng.randrange(8, vocab) for _ in range(4)], [rng.randrange(8, vocab) for _ in range(20)]]
    # The prefix-sharing prompts first: admitted while the first batch's blocks are still cached.
    second = [prefix + [rng.randrange(8, vocab) for _ in range(n)] for n in (6, 9)]
    second += [first[1]]  # asked again: suffix decoding drafts the first answer
    second += [[rng.randrange(8, vocab) for _ in range(n)] for n in (37, 45)]
    return first, second


@functools.cache
def _hf_generate(path: Path, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens, once per checkpoint and prompt (tp 1 and 2 share them)."""
    model = hf_model(path)
    output = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )
    return output[0, len(prompt):].tolist()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


# Mixture-of-experts architectures also run with --enable-expert-parallel at 2 ranks.
MOE_ARCHITECTURES = ("GptOssForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
RUNS = [(architecture, parallel) for architecture in ARCHITECTURES
        for parallel in ("tp1", "tp2", *(("ep2",) if architecture in MOE_ARCHITECTURES else ()))]


@pytest.mark.slow
@pytest.mark.parametrize(("architecture", "parallel"), RUNS)
def test_engine_greedy_matches_hf_with_prefix_hits_chunks_preemption_and_drafts(architecture: str,
                                                                                parallel: str) -> None:
    tp, expert_parallel = (1 if parallel == "tp1" else 2), parallel == "ep2"
    make_checkpoint, num_kv_blocks = ARCHITECTURES[architecture]
    path = make_checkpoint()
    assert hf_model(path).config.architectures == [architecture]
    first, second = _prompts(hf_model(path).config.vocab_size)
    speculative = {"method": "suffix", "num_speculative_tokens": 3, "policy": "always"}
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=num_kv_blocks, max_num_batched_tokens=BUDGET,
              max_model_len=128, speculative_config=speculative, tensor_parallel_size=tp,
              enable_expert_parallel=expert_parallel)
    try:
        core: Any = llm.engine_core
        assert (core.ready.executor, core.ready.world_size) == ("uni" if tp == 1 else "mp", tp)
        mixed_steps = _count_mixed_steps(llm)
        for prompts in (first, second):
            outputs = _generate(llm, prompts)
            assert [list(o.outputs[0].token_ids) for o in outputs] == [_hf_generate(path, tuple(p)) for p in prompts]
        assert [o.num_cached_tokens >= PREFIX_LEN for o in outputs[:2]] == [True, True]  # the first batch's prefix
        scheduler = core.engine_core.scheduler
        assert scheduler.num_preemptions > 0
        assert scheduler.total_spec_decoding_stats.num_accepted_tokens > 0
        assert mixed_steps[0] > 0
        if expert_parallel:  # the MoE layers went all-to-all
            stats = core.engine_core.model_executor.collective_rpc("collective_stats")
            assert all(rank["ep_num_collectives"] > 0 for rank in stats)
    finally:
        llm.shutdown()
