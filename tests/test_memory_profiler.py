"""The profile run and the engine's use of a platform's KV budget."""

from __future__ import annotations

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.engine.builder import build_engine
from pagedllm.platforms.cpu.platform import DEFAULT_CPU_KV_CACHE_BYTES, CpuPlatform


def test_engine_sizes_the_pool_from_the_platform_budget_after_a_profile_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def budget(self: CpuPlatform, utilization: float, profile_run) -> int:
        seen["utilization"] = utilization
        profile_run()  # the largest batch: must run on the loaded model without a bound cache
        return 3 * 1024 * 1024

    monkeypatch.setattr(CpuPlatform, "kv_cache_budget_bytes", budget)
    parts = build_engine(
        EngineConfig.from_flat(model="tiny", gpu_memory_utilization=0.5, max_num_batched_tokens=64, max_num_seqs=8)
    )
    model = parts.model
    config = model.hf_config
    bytes_per_block = (2 * config.num_hidden_layers * 16 * config.num_key_value_heads * model.head_size
                       * model.dtype.itemsize)
    assert seen["utilization"] == 0.5
    assert parts.engine_core.kv_cache_manager.num_blocks == 3 * 1024 * 1024 // bytes_per_block
    # The throwaway cache is gone; the real one is bound.
    runner = parts.executor.driver_worker.model_runner
    layers = runner.model.get_attention_layers()
    assert all(layer.kv_cache is kv for layer, kv in zip(layers, runner.kv_caches, strict=True))


def test_cpu_budget_is_the_fixed_default() -> None:
    budget = CpuPlatform().kv_cache_budget_bytes(0.9, lambda: pytest.fail("CPU does not profile"))
    assert budget == DEFAULT_CPU_KV_CACHE_BYTES


def test_profile_run_unbinds_its_throwaway_cache() -> None:
    from pagedllm.worker.memory_profiler import profile_run

    parts = build_engine(EngineConfig.from_flat(model="tiny", num_kv_blocks=8))
    model = parts.executor.driver_worker.model_runner.model
    for layer in model.get_attention_layers():
        layer.kv_cache = None
    facts = parts.model
    profile_run(model, parts.attn_selection.backend_cls, num_tokens=40, num_logit_rows=4, block_size=16,
                num_kv_heads=facts.num_kv_heads, head_size=facts.head_size, kv_cache_dtype=facts.kv_cache_dtype,
                device=parts.device)
    assert all(layer.kv_cache is None for layer in model.get_attention_layers())
