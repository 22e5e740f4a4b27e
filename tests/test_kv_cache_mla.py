"""A latent (MLA) model's KV cache through the engine: one latent vector per
token and layer (bytes per block by hand), the same on every rank, and its
blocks through a KV connector into a fresh engine."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from test_models_deepseek import build_deepseek

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache.kv_cache_interface import MLAAttentionSpec

BLOCK_SIZE = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@functools.cache
def _checkpoint(folder: Path) -> Path:
    return build_deepseek("DeepseekV2ForCausalLM", folder / "model")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("deepseek-v2"))


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_latent_cache_holds_one_vector_per_token_on_every_rank(checkpoint: Path, tp: int) -> None:
    # 2 layers x 16 tokens x (kv_lora_rank 32 + qk_rope_head_dim 8) x 4 bytes:
    # no K and V, no heads (4 query heads would make per-head K/V 2 x 4 x 24 wide).
    bytes_per_block = 2 * BLOCK_SIZE * (32 + 8) * 4
    budget = 7 * bytes_per_block + 100
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_memory_bytes=budget, block_size=BLOCK_SIZE,
              tensor_parallel_size=tp)
    try:
        executor: Any = llm.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
        assert executor.collective_rpc("determine_num_kv_blocks") == [7] * tp
        if tp == 1:
            worker = executor.driver_worker
            (group,) = worker.kv_cache_config().kv_cache_groups
            assert group.kv_cache_spec == MLAAttentionSpec(BLOCK_SIZE, kv_lora_rank=32, qk_rope_head_dim=8)
            caches = worker.model_runner.kv_caches
            assert [tuple(c.shape) for c in caches] == [(1, 7, BLOCK_SIZE, 1, 40)] * 2
            assert sum(c.numel() * c.element_size() for c in caches) == 7 * bytes_per_block
        assert _tokens(llm, [[11, 12, 13]]) and llm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    finally:
        llm.shutdown()


def test_latent_blocks_round_trip_through_a_kv_connector(checkpoint: Path, tmp_path: Path) -> None:
    """Blocks saved by one engine (shared_storage) load into a fresh one
    without prefix caching: the same tokens, the full blocks not recomputed."""
    prompts = [[(7 * i + 3 * r) % 8000 + 10 for i in range(2 * BLOCK_SIZE + 5)] for r in range(2)]
    common: dict[str, Any] = dict(model=str(checkpoint), dtype="float32", num_kv_blocks=32, block_size=BLOCK_SIZE)
    storage = {"connector": "shared_storage", "extra": {"path": str(tmp_path)}}
    expected = _tokens(LLM(**common), prompts)
    _tokens(LLM(**common, kv_transfer_config={**storage, "role": "producer"}), prompts)
    assert len(list(tmp_path.rglob("*.safetensors"))) == 2 * 2
    consumer = LLM(**common, enable_prefix_caching=False, kv_transfer_config={**storage, "role": "consumer"})
    outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [2 * BLOCK_SIZE] * 2


def test_the_kv_fingerprint_names_the_latent_layout(checkpoint: Path) -> None:
    """Latent blocks never load into a per-head cache of equal size, nor the other way."""
    import torch

    from pagedllm.kv_connectors.base import model_fingerprint

    args = (str(checkpoint), torch.float32, BLOCK_SIZE, 2, 1, 40)
    assert model_fingerprint(*args, latent=True) != model_fingerprint(*args)
