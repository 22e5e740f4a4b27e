"""What cannot run at tensor_parallel_size > 1 is a ConfigError naming the
field, the value and what is allowed, raised by `plan_ranks` in the engine
process, before any rank process starts (issue 15)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.tiny_gpt2 import cached_tiny_gpt2
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.executors.mp import MultiprocExecutor
from pagedllm.plugins import get_plugin_manager
from pagedllm.worker.worker import plan_ranks

NUM_KV_BLOCKS = 16


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def started_ranks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records an mp executor starting its ranks (and starts none)."""
    starts: list[int] = []
    monkeypatch.setattr(MultiprocExecutor, "_start_ranks", lambda self: starts.append(self.world_size))
    return starts


def _plan(model: str, tp_size: int, **flat: Any) -> None:
    config = EngineConfig.from_flat(model=model, num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=tp_size, **flat)
    plan_ranks(config, get_plugin_manager())


def test_gpt2_example_model_at_tp2_is_refused_before_any_rank_starts(started_ranks: list[int]) -> None:
    from pagedllm_example_model.gpt2 import GPT2LMHeadModel

    assert GPT2LMHeadModel.supports_tensor_parallel is False  # the example says so itself
    with pytest.raises(ConfigError) as info:
        LLM(model=str(cached_tiny_gpt2()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=2)
    assert (info.value.key, info.value.value) == ("parallel.tensor_parallel_size", 2)
    assert info.value.allowed == (
        "1: architecture GPT2LMHeadModel does not support tensor parallelism "
        "(its model class does not declare supports_tensor_parallel = True)"
    )
    assert started_ranks == []


def test_gpt2_example_model_at_tp1_plans() -> None:
    _plan(str(cached_tiny_gpt2()), 1)


def test_a_kv_connector_without_tensor_parallel_support_at_tp2_is_refused_before_any_rank_starts(
    started_ranks: list[int],
) -> None:
    """The example `memory_store` (one process's block store, tensors in its
    metadata) does not register supports_tensor_parallel; the built-ins do."""
    transfer = {"connector": "memory_store", "extra": {"namespace": "tp2"}}
    with pytest.raises(ConfigError) as info:
        LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=2, kv_transfer_config=transfer)
    assert (info.value.key, info.value.value) == ("kv_transfer.connector", "memory_store")
    assert info.value.allowed == (
        "a connector registered with supports_tensor_parallel=True at tensor_parallel_size 2 "
        "('memory_store' does not declare it)"
    )
    assert started_ranks == []
    for connector in ("shared_storage", "cpu_offload"):
        registration = get_plugin_manager().kv_connectors.get(connector)
        assert registration.info.supports_tensor_parallel is True


@pytest.mark.parametrize(
    ("overrides", "tp_size", "allowed"),
    [
        ({}, 3, "a divisor of the model's attention heads (4)"),
        # 3 KV heads: 2 ranks cannot split them, 4 ranks cannot replicate them evenly
        ({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3}, 2,
         "a divisor or a multiple of the model's key/value heads (3)"),
        ({"hidden_size": 48, "num_attention_heads": 12, "num_key_value_heads": 3}, 4,
         "a divisor or a multiple of the model's key/value heads (3)"),
    ],
)
def test_heads_that_do_not_split_are_refused(overrides: dict[str, Any], tp_size: int, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(str(cached_tiny_model("llama", **overrides)), tp_size)
    assert (info.value.key, info.value.value, info.value.allowed) == ("parallel.tensor_parallel_size", tp_size, allowed)


@pytest.mark.parametrize(
    ("kv_heads", "tp_size", "per_rank"), [(2, 2, (2, 1, 1)), (1, 2, (2, 1, 2)), (2, 4, (1, 1, 2)), (4, 2, (2, 2, 1))]
)
def test_heads_per_rank_split_queries_and_split_or_replicate_kv_heads(
    kv_heads: int, tp_size: int, per_rank: tuple[int, int, int]
) -> None:
    from pagedllm.worker.worker import read_model_facts

    config = EngineConfig.from_flat(model=str(cached_tiny_model("llama", num_key_value_heads=kv_heads)))
    platform, _, _ = plan_ranks(config, get_plugin_manager())
    facts = read_model_facts(config, platform, get_plugin_manager())
    assert tuple(facts.heads_per_rank(tp_size)) == per_rank  # (query heads, KV heads, KV head replicas)
