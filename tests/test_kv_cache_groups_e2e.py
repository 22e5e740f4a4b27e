"""An engine with KV cache groups (float32, LLM) against transformers.

A Qwen2 checkpoint whose second layer slides a 6-token window (the first
keeps full attention) runs with two KV cache groups: every layer reads its
own group's block table, and the window group frees its blocks as requests
decode far past the window. Greedy tokens must equal transformers' and the
engine's with groups off, eager and through decode graphs; at the same KV
memory, groups fit the batch that a full-length cache must preempt.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache.hybrid_manager import HybridKVCacheManager

NUM_NEW_TOKENS = 24
WINDOW = 6
BLOCK_SIZE = 4
PROMPT_LENS = (5, 13, 21, 9)
# Full-length caches need 39 blocks of both layers at the end; groups need
# 39 of the full layer's and about 12 of the window layer's (one layer each).
LAYER_BLOCKS = 56

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path() -> Any:
    return cached_tiny_model("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def random_prompts(lengths: tuple[int, ...], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(8, 512) for _ in range(n)] for n in lengths]


def hf_greedy(path: Any, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
            )
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def engine_core(llm: LLM) -> Any:
    return llm.engine_core.engine_core  # type: ignore[attr-defined]


def test_groups_match_hf_and_fit_what_full_length_caches_preempt(model_path: Any) -> None:
    prompts = random_prompts(PROMPT_LENS, seed=1)
    expected = hf_greedy(model_path, prompts)
    # One KV tensor per block with groups (the two layers share it), two without.
    grouped = LLM(model=str(model_path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=LAYER_BLOCKS)
    manager = engine_core(grouped).scheduler.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager) and manager.num_kv_cache_groups == 2
    assert token_ids(generate(grouped, prompts)) == expected
    assert engine_core(grouped).scheduler.num_preemptions == 0
    # Decode steps replayed graphs that copy both groups' block tables.
    graphs = engine_core(grouped).model_executor.driver_worker.model_runner.graph_runner
    assert graphs is not None and graphs.num_replays > 0 and len(graphs.other_block_tables) == 1
    plain = LLM(
        model=str(model_path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=LAYER_BLOCKS // 2,
        disable_hybrid_kv_cache_manager=True,
    )
    assert engine_core(plain).scheduler.kv_cache_manager.num_kv_cache_groups == 1
    assert token_ids(generate(plain, prompts)) == expected
    assert engine_core(plain).scheduler.num_preemptions > 0


def test_prefix_hits_with_groups_match_hf(model_path: Any) -> None:
    prefix = random_prompts((16,), seed=7)[0]
    first = random_prompts((3, 7), seed=2, prefix=prefix)
    second = random_prompts((5, 2), seed=3, prefix=prefix)
    llm = LLM(model=str(model_path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128)
    assert token_ids(generate(llm, first)) == hf_greedy(model_path, first)
    outputs = generate(llm, second)
    assert token_ids(outputs) == hf_greedy(model_path, second)
    # The full group hits the whole prefix; the window group its last blocks.
    assert [output.num_cached_tokens for output in outputs] == [16, 16]


def test_chunked_prefill_and_async_scheduling_with_groups_match_hf(model_path: Any) -> None:
    # 5-token chunks: the window group frees blocks between a prompt's chunks.
    prompts = random_prompts((13, 21), seed=4)
    llm = LLM(
        model=str(model_path), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64,
        long_prefill_token_threshold=5, async_scheduling=True,
    )
    assert token_ids(generate(llm, prompts)) == hf_greedy(model_path, prompts)
