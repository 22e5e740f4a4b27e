"""Each rank's share of the model and the KV cache at tensor_parallel_size 2
(issue 15): a rank holds its KV heads only (half of TP=1's cache with 2 KV
heads, all of it with 1 replicated head), its slice of the sharded weights
and whole replicated ones, measured from the ranks' own tensors; and stored
KV blocks are named by the tensor-parallel layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from helpers.tp_weights import expected_weight_bytes

from pagedllm import LLM
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.kv_connectors.base import model_fingerprint
from pagedllm.model_registry.loader import load_hf_config
from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.plugins import get_plugin_manager

NUM_KV_BLOCKS = 24
FLOAT32_BYTES = 4


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    torch.set_num_threads(1)


def test_fingerprint_names_the_tensor_parallel_layout(tmp_path: Path) -> None:
    def fingerprint(num_kv_heads: int, **layout: int) -> str:
        return model_fingerprint(str(tmp_path), torch.float32, 16, 2, num_kv_heads, 8, **layout)

    tp1 = fingerprint(2)
    tp2 = [fingerprint(1, tp_size=2, tp_rank=rank) for rank in (0, 1)]
    tp4_rank0 = fingerprint(1, tp_size=4, tp_rank=0)  # one KV head per rank, as at TP=2: only the layout differs
    assert len({tp1, *tp2, tp4_rank0}) == 4
    assert [fingerprint(1, tp_size=2, tp_rank=rank) for rank in (0, 1)] == tp2  # the same layout, the same name
    assert fingerprint(2, tp_size=1, tp_rank=0) == tp1  # TP=1 names stay what they were


def _memory_usage(model: str, tensor_parallel_size: int) -> list[dict[str, int]]:
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    try:
        executor = llm.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
        assert llm.engine_core.ready.world_size == tensor_parallel_size
        return executor.collective_rpc("memory_usage")
    finally:
        llm.shutdown()


def _expected_kv_cache_bytes(hf_config: Any, num_kv_heads: int, block_size: int) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_layer = 2 * NUM_KV_BLOCKS * block_size * num_kv_heads * head_dim * FLOAT32_BYTES  # K and V
    return hf_config.num_hidden_layers * per_layer


def _model_path(name: str) -> str:
    if name == "tiny":
        from pagedllm.model_registry.tiny import get_default_model_dir

        return str(get_default_model_dir())
    return str(cached_tiny_model("llama", with_tokenizer=True, num_key_value_heads=int(name.split("-")[1])))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "llama-2-kv-heads", "llama-1-kv-head"])
def test_each_rank_holds_its_share_of_weights_and_kv_cache(name: str) -> None:
    path = _model_path(name)
    hf_config = load_hf_config(path)
    block_size = EngineConfig().cache.block_size
    (tp1,) = _memory_usage(path, 1)
    ranks = _memory_usage(path, 2)

    assert tp1["kv_cache_bytes"] == _expected_kv_cache_bytes(hf_config, hf_config.num_key_value_heads, block_size)
    assert tp1["weights_bytes"] == expected_weight_bytes(hf_config, 1, FLOAT32_BYTES)
    for usage in ranks:
        # One KV head per rank: its half of two, or the one head replicated.
        assert usage["kv_cache_bytes"] == _expected_kv_cache_bytes(hf_config, 1, block_size)
        assert usage["weights_bytes"] == expected_weight_bytes(hf_config, 2, FLOAT32_BYTES)
        # Sharded matrices halve; norms, rotary tables and a replicated KV head do not.
        assert 0.5 <= usage["weights_bytes"] / tp1["weights_bytes"] < 0.6
    if hf_config.num_key_value_heads == 2:
        assert [usage["kv_cache_bytes"] * 2 for usage in ranks] == [tp1["kv_cache_bytes"]] * 2
    else:  # one KV head, replicated on both ranks
        assert [usage["kv_cache_bytes"] for usage in ranks] == [tp1["kv_cache_bytes"]] * 2


def _kv_bytes_per_block(path: str, tp_size: int, block_size: int) -> int:
    """One block of every layer on one rank: its share of the KV heads (one
    head, replicated, when there are fewer than ranks)."""
    hf_config = load_hf_config(path)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = max(hf_config.num_key_value_heads // tp_size, 1)
    return hf_config.num_hidden_layers * 2 * block_size * kv_heads * head_dim * FLOAT32_BYTES


@pytest.mark.slow
def test_the_memory_budget_is_per_rank_target_and_draft_model_alike() -> None:
    """The same kv_cache_memory_bytes holds twice the blocks on each of 2
    ranks (the target's and the draft model's caches both halve)."""
    budget = 3 * 1000 * 1000 + 7  # not a multiple of either block size
    speculative = {"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-draft"}
    target, draft = (resolve_model_path(name, get_plugin_manager()) for name in ("tiny", "tiny-draft"))
    for tp_size in (1, 2):
        llm = LLM("tiny", tensor_parallel_size=tp_size, dtype="float32", kv_cache_memory_bytes=budget,
                  speculative_config=speculative)
        try:
            executor = llm.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
            block_size = llm.config.cache.block_size
            per_block = _kv_bytes_per_block(target, tp_size, block_size) + _kv_bytes_per_block(
                draft, tp_size, block_size
            )
            assert executor.collective_rpc("determine_num_kv_blocks") == [budget // per_block] * tp_size
        finally:
            llm.shutdown()


def test_a_kv_cache_with_other_kv_heads_than_its_layer_is_refused() -> None:
    """A backend views the cache with its layer's KV heads, so a cache of
    more heads (the whole model's, on one rank) would run unnoticed."""
    from pagedllm.attention_backends.torch_native import TorchNativeBackend
    from pagedllm.model_registry.kv_cache import allocate_kv_caches
    from pagedllm.model_registry.layers.attention import Attention

    class OneLayer:
        layer = Attention(2, 8, 8**-0.5, 1, TorchNativeBackend)  # this rank: 2 query heads, 1 KV head

        def get_attention_layers(self) -> list[Attention]:
            return [self.layer]

    geometry = dict(num_blocks=2, block_size=4, head_size=8, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="a KV cache of 2 KV heads for a layer of 1"):
        allocate_kv_caches(OneLayer(), TorchNativeBackend, num_kv_heads=2, **geometry)  # type: ignore[arg-type]
    (kv_cache,) = allocate_kv_caches(OneLayer(), TorchNativeBackend, num_kv_heads=1, **geometry)  # type: ignore[arg-type]
    assert kv_cache.shape == TorchNativeBackend.get_kv_cache_shape(2, 4, 1, 8)


@pytest.mark.parametrize("tp_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_budget_below_one_block_names_the_bytes_of_one_block_per_rank(tp_size: int) -> None:
    """At TP=2 the ranks find it (in their processes): it still reaches the
    user as the ConfigError, not as a failed rank."""
    with pytest.raises(ConfigError) as info:
        LLM("tiny", dtype="float32", kv_cache_memory_bytes=1000, tensor_parallel_size=tp_size)
    block_size = EngineConfig().cache.block_size
    per_block = _kv_bytes_per_block(resolve_model_path("tiny", get_plugin_manager()), tp_size, block_size)
    assert (info.value.key, info.value.value) == ("cache.kv_cache_memory_bytes", 1000)
    assert info.value.allowed == (
        f">= {per_block} (one block of this model per rank at tensor_parallel_size {tp_size})"
    )
