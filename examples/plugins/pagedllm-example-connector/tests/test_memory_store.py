"""memory_store: selected by name through the entry point, and a consumer
engine loads what a producer engine stored instead of computing it."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams


def _installed() -> bool:
    from pagedllm.plugins import get_plugin_manager

    get_plugin_manager().load()
    return "memory_store" in get_plugin_manager().registry("kv_connector")


def test_consumer_loads_the_producers_blocks_and_generates_the_same_tokens() -> None:
    if not _installed():
        pytest.skip("the package is not installed (pip install -e examples/plugins/pagedllm-example-connector)")
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 400) for _ in range(70)] for _ in range(3)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(model="tiny", dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in LLM(**common).generate(requests, params, use_tqdm=False)]

    def kv(role: str) -> dict:
        return {"connector": "memory_store", "role": role, "extra": {"namespace": "test-consumer"}}

    producer = LLM(**common, kv_transfer_config=kv("producer"))
    assert [o.outputs[0].token_ids for o in producer.generate(requests, params, use_tqdm=False)] == expected
    consumer = LLM(**common, kv_transfer_config=kv("consumer"))
    outputs = consumer.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # 70-token prompts: 4 full blocks (64 tokens) each came from the store.
    assert [o.num_cached_tokens for o in outputs] == [64, 64, 64]
    stats = consumer.engine_core.engine_core.kv_connector.stats
    assert stats.external_hits == 3 * 64 and stats.tier_hits == {"memory_store": 12}


def test_a_namespace_is_required() -> None:
    if not _installed():
        pytest.skip("the package is not installed")
    from pagedllm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="kv_transfer.extra.namespace"):
        LLM(model="tiny", num_kv_blocks=16, kv_transfer_config={"connector": "memory_store"})


def test_max_blocks_option_caps_what_the_producer_stores() -> None:
    if not _installed():
        pytest.skip("the package is not installed")
    from pagedllm_example_connector.options import MemoryStoreOptions

    from pagedllm.plugins import get_plugin_manager

    rng = random.Random(1)
    requests = [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(70)]} for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kv = {"connector": "memory_store", "extra": {"namespace": "test-max-blocks"}}
    options = {"example_connector": {"max_blocks": 2}}
    common = dict(model="tiny", dtype="float32", num_kv_blocks=64, plugin_config=options)
    try:
        producer = LLM(**common, kv_transfer_config={**kv, "role": "producer"})
        assert get_plugin_manager().plugin_config(MemoryStoreOptions).max_blocks == 2
        producer.generate(requests, params, use_tqdm=False)
        assert len(producer.engine_core.engine_core.kv_connector.store.blocks) == 2
        consumer = LLM(**common, kv_transfer_config={**kv, "role": "consumer"})
        outputs = consumer.generate(requests, params, use_tqdm=False)
        # Only the first prompt's first two blocks were stored (saved in batch order).
        assert [o.num_cached_tokens for o in outputs] == [32, 0, 0]
    finally:
        get_plugin_manager().load(config={})


def test_an_invalid_option_fails_at_start_naming_it() -> None:
    if not _installed():
        pytest.skip("the package is not installed")
    from pagedllm.core.errors import ConfigError
    from pagedllm.plugins import get_plugin_manager

    kv = {"connector": "memory_store", "extra": {"namespace": "test-invalid"}}
    try:
        with pytest.raises(ConfigError) as info:
            LLM(model="tiny", num_kv_blocks=16, kv_transfer_config=kv,
                plugin_config={"example_connector": {"max_blocks": 0}})
        assert str(info.value) == "plugins.config.example_connector.max_blocks=0 is invalid; allowed: >= 1"
    finally:
        get_plugin_manager().load(config={})
