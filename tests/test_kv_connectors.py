"""KV connectors: shared-storage disaggregated prefill across engine
processes, the CPU offload tier (under the `uni`, `mp` and `ray` executors:
the builder builds one scheduler side for each), load failures under both
policies, config and metrics (the delayed-free contract and tensor
parallelism: tests/test_tp_kv_connectors.py). Every expectation of generated
tokens comes from a plain engine (no connector) in the same test."""

from __future__ import annotations

import os

# NOTE: before Ray is imported anywhere (the `ray` case): Ray then binds
# 127.0.0.1 only and sends no usage report (as in tests/test_ray_executor.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams

BLOCK = 16
COMMON: dict[str, Any] = dict(model="tiny", dtype="float32")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


def _prompts(num: int, length: int, seed: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(shared_prefix or []) + [rng.randrange(10, 4000) for _ in range(length)] for _ in range(num)]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _reference(prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    return _tokens(_generate(LLM(**COMMON, num_kv_blocks=128, **kwargs), prompts))


def _storage(path: Path, role: str, **kwargs: Any) -> dict[str, Any]:
    return {"connector": "shared_storage", "role": role, "extra": {"path": str(path)}, **kwargs}


def _core(llm: LLM) -> Any:
    return llm.engine_core.engine_core


def _stats(llm: LLM) -> Any:
    """The connector's counts: its scheduler side's and its worker side's."""
    return _core(llm).scheduler.kv_connector_stats


def _assert_no_block_leak(llm: LLM) -> None:
    manager = _core(llm).kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants([])


# ------------------------------------------------------------ shared storage


PRODUCER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pagedllm import LLM, SamplingParams
    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=128,
              kv_transfer_config={"connector": "shared_storage", "role": "producer", "extra": {"path": path}})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
    """
)


def test_producer_and_consumer_processes_match_one_engine_and_the_consumer_skips_the_prefix(
    tmp_path: Path,
) -> None:
    import json

    shared = _prompts(1, 5 * BLOCK, seed=1)[0]  # 80 tokens: 5 full blocks
    prompts = _prompts(4, 21, seed=2, shared_prefix=shared)  # 101 tokens: 6 full blocks
    # The producer: another engine process, prefill only (max_tokens 1).
    result = subprocess.run(
        [sys.executable, "-c", PRODUCER_SCRIPT, str(tmp_path), json.dumps(prompts)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stored = list(tmp_path.rglob("*.safetensors"))
    # The shared 5 blocks once, plus the 6th block of each prompt.
    assert len(stored) == 5 + 4 and not list(tmp_path.rglob(".tmp-*"))

    expected = _reference(prompts)
    consumer = LLM(**COMMON, num_kv_blocks=128, enable_prefix_caching=False,
                   kv_transfer_config=_storage(tmp_path, "consumer"))
    outputs = _generate(consumer, prompts)
    assert _tokens(outputs) == expected
    # Each prompt loaded its 6 full blocks (96 tokens) and computed the other 5.
    assert [o.num_cached_tokens for o in outputs] == [96] * 4
    assert _core(consumer).scheduler.num_prompt_tokens_computed == 4 * (101 - 96)
    stats = _stats(consumer)
    assert stats.external_hits == 4 * 96 and stats.external_queries == 4 * 101
    assert stats.tier_hits == {"shared_storage": 24}
    _assert_no_block_leak(consumer)


def test_a_prompt_of_whole_blocks_still_computes_its_last_token(tmp_path: Path) -> None:
    prompts = _prompts(2, 4 * BLOCK, seed=3)  # exactly 4 blocks
    producer = LLM(**COMMON, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path, "producer"))
    _generate(producer, prompts)
    consumer = LLM(**COMMON, num_kv_blocks=64, enable_prefix_caching=False,
                   kv_transfer_config=_storage(tmp_path, "consumer"))
    outputs = _generate(consumer, prompts)
    assert _tokens(outputs) == _reference(prompts)
    assert [o.num_cached_tokens for o in outputs] == [3 * BLOCK] * 2  # the 4th block holds the last token


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupted":
        flipped = bytearray(data)
        flipped[-10] ^= 0xFF  # inside the tensor data, past the header
        path.write_bytes(bytes(flipped))


def _stored_block(tmp_path: Path, llm: LLM, prompt: list[int], index: int) -> Path:
    from pagedllm.core.request import Request

    connector = _core(llm).kv_connector  # the scheduler side: it knows where blocks are stored
    request = Request("probe", prompt, SamplingParams(max_tokens=1), None)
    _core(llm).kv_cache_manager.ensure_block_hashes(request)
    return connector.block_path(request.block_hashes[index])


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted"])
def test_a_bad_stored_block_is_recomputed_under_recompute(tmp_path: Path, how: str) -> None:
    prompts = _prompts(2, 4 * BLOCK + 5, seed=4)
    producer = LLM(**COMMON, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path, "producer"))
    _generate(producer, prompts)
    consumer = LLM(**COMMON, num_kv_blocks=64, enable_prefix_caching=False,
                   kv_transfer_config=_storage(tmp_path, "consumer", load_failure_policy="recompute"))
    _corrupt(_stored_block(tmp_path, consumer, prompts[0], 2), how)
    outputs = _generate(consumer, prompts)
    assert _tokens(outputs) == _reference(prompts)
    # The first prompt stops at its bad block 2; the second is whole.
    assert [o.num_cached_tokens for o in outputs] == [2 * BLOCK, 4 * BLOCK]
    # Block 3 is stored, so a missing block 2 is a lost file too.
    assert _stats(consumer).load_failures == 1
    _assert_no_block_leak(consumer)


@pytest.mark.parametrize("how", ["missing", "truncated", "corrupted"])
def test_a_bad_stored_block_fails_only_its_request_under_fail(tmp_path: Path, how: str) -> None:
    prompts = _prompts(2, 4 * BLOCK + 5, seed=5)
    producer = LLM(**COMMON, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path, "producer"))
    _generate(producer, prompts)
    consumer = LLM(**COMMON, num_kv_blocks=64, enable_prefix_caching=False,
                   kv_transfer_config=_storage(tmp_path, "consumer", load_failure_policy="fail"))
    bad = _stored_block(tmp_path, consumer, prompts[0], 1)
    _corrupt(bad, how)  # blocks 2 and 3 stay stored
    failed, ok = _generate(consumer, prompts)
    assert failed.outputs[0].finish_reason == "abort" and failed.outputs[0].token_ids == []
    reason = str(failed.outputs[0].stop_reason)
    assert "could not load block" in reason and bad.stem in reason and "shared_storage" in reason
    assert _tokens([ok]) == _reference(prompts[1:])
    _assert_no_block_leak(consumer)


def test_a_missing_directory_setting_is_a_config_error() -> None:
    from pagedllm.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv_transfer\.extra\.path"):
        LLM(**COMMON, num_kv_blocks=16, kv_transfer_config={"connector": "shared_storage"})


def test_unknown_connector_and_unsupported_role_are_config_errors(tmp_path: Path) -> None:
    from pagedllm.core.errors import ConfigError, UnknownComponentError

    with pytest.raises(UnknownComponentError, match="shared_storage"):
        LLM(**COMMON, num_kv_blocks=16, kv_transfer_config={"connector": "nope"})
    with pytest.raises(ConfigError, match=r"kv_transfer\.role"):
        LLM(**COMMON, num_kv_blocks=16, kv_transfer_config={"connector": "cpu_offload", "role": "producer"})


# --------------------------------------------------------------- CPU offload


@pytest.fixture
def sides_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The side (`context.side`) of every connector built in this process."""
    from pagedllm.kv_connectors.base import KVConnectorBase

    sides: list[str] = []
    init = KVConnectorBase.__init__

    def counting_init(self: KVConnectorBase, config: Any, context: Any) -> None:
        sides.append(str(context.side))
        init(self, config, context)

    monkeypatch.setattr(KVConnectorBase, "__init__", counting_init)
    return sides


@pytest.mark.parametrize("executor", ["uni", "mp", pytest.param("ray", marks=pytest.mark.slow)])
def test_a_prefix_evicted_from_a_small_pool_comes_back_from_the_cpu_tier(
    executor: str, sides_built: list[str]
) -> None:
    prompts = _prompts(4, 4 * BLOCK + 6, seed=6)  # 70 tokens + 8 generated: 5 blocks each
    expected = _reference(prompts)
    llm = LLM(**COMMON, num_kv_blocks=12, distributed_executor_backend=executor,
              kv_transfer_config={"connector": "cpu_offload", "extra": {"cpu_bytes": 64 << 20}})
    try:
        # One scheduler side, the builder's, whatever the executor; the rank
        # builds its worker side (in this process only with `uni`).
        assert sides_built == (["worker", "scheduler"] if executor == "uni" else ["scheduler"])
        assert _core(llm).kv_connector.context.side == "scheduler"
        # One at a time: B, C and D push A's cached blocks out of the 12-block pool.
        first = [_generate(llm, [p])[0] for p in prompts]
        assert _tokens(first) == expected
        again = _generate(llm, prompts[:1])[0]
        assert list(again.outputs[0].token_ids) == expected[0]
        assert again.num_cached_tokens == 4 * BLOCK  # all 4 full prompt blocks, from CPU memory
        stats = _stats(llm)
        assert stats.tier_hits["cpu"] >= 4 and stats.external_hits >= 4 * BLOCK
        # Saved and loaded by the rank's worker side, reported with its step outputs.
        assert stats.tier_bytes_saved["cpu"] > 0 and stats.tier_bytes_loaded["cpu"] > 0
        _assert_no_block_leak(llm)
    finally:
        llm.shutdown()


def test_the_cpu_tier_is_bounded_and_least_recently_used_goes_first() -> None:
    from pagedllm.kv_connectors.cpu_offload import CpuBlockIndex

    index = CpuBlockIndex(capacity_bytes=3 * 256)  # blocks of 256 bytes
    assert [index.put(key, 256) for key in (b"a", b"b", b"c")] == [[], [], []]
    assert index.touch(b"a") and not index.touch(b"z")  # a is now the most recent
    assert index.put(b"d", 256) == [b"b"]
    assert b"b" not in index and all(k in index for k in (b"a", b"c", b"d"))
    assert index.num_bytes == 3 * 256
    assert index.put(b"huge", 4 * 256) == []  # larger than the tier: not kept, nothing dropped
    assert b"huge" not in index and len(index) == 3
    assert index.put(b"e", 2 * 256) == [b"c", b"a"]  # least recently used first
    assert index.num_bytes == 3 * 256 and len(index) == 2


def test_offload_keeps_outputs_under_a_workload_that_cycles_more_prefixes_than_fit() -> None:
    shared = [_prompts(1, 3 * BLOCK, seed=10 + i)[0] for i in range(4)]
    prompts = [shared[i % 4] + _prompts(1, 5, seed=100 + i)[0] for i in range(12)]
    expected = _reference(prompts)
    llm = LLM(**COMMON, num_kv_blocks=10, kv_transfer_config={"connector": "cpu_offload"})
    got = [_generate(llm, [p])[0] for p in prompts]
    assert _tokens(got) == expected
    stats = _stats(llm)
    assert stats.tier_hits["cpu"] > 0
    _assert_no_block_leak(llm)


# ------------------------------------------------------------ config


def test_kv_transfer_config_from_a_file_and_from_flags(tmp_path: Path) -> None:
    from pagedllm.core.config import EngineConfig
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.config_flags import engine_config_overrides

    config_file = tmp_path / "engine.yaml"
    config_file.write_text(
        f"kv_transfer:\n  connector: shared_storage\n  role: consumer\n  extra:\n    path: {tmp_path}\n"
    )
    config = EngineConfig.from_flat(config_file=str(config_file))
    assert (config.kv_transfer.connector, config.kv_transfer.role) == ("shared_storage", "consumer")
    assert config.kv_transfer.extra == {"path": str(tmp_path)}
    assert config.kv_transfer.load_failure_policy == "recompute"
    args = build_parser().parse_args(
        ["serve", "--kv-connector", "cpu_offload", "--kv-connector-extra-config", '{"cpu_bytes": 1024}',
         "--load-failure-policy", "fail"]
    )
    overrides = engine_config_overrides(args)
    assert overrides["kv_transfer"] == {"connector": "cpu_offload", "extra": {"cpu_bytes": 1024},
                                        "load_failure_policy": "fail"}
    from pagedllm.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv_transfer\.load_failure_policy"):
        EngineConfig.from_flat(kv_transfer_config={"connector": "x", "load_failure_policy": "retry"})


def test_connector_counters_reach_prometheus(tmp_path: Path) -> None:
    from pagedllm.engine.metrics import StatLoggerManager

    prompts = _prompts(2, 3 * BLOCK + 2, seed=8)
    producer = LLM(**COMMON, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path, "producer"))
    _generate(producer, prompts)
    consumer = LLM(**COMMON, num_kv_blocks=64, enable_prefix_caching=False,
                   kv_transfer_config=_storage(tmp_path, "consumer"))
    _generate(consumer, prompts)
    manager = StatLoggerManager("m")
    manager.record(_core(consumer).scheduler.make_stats(), None)
    text = manager.render().decode()
    assert 'pagedllm:external_prefix_cache_queries_total{model_name="m"} 100.0' in text
    assert 'pagedllm:external_prefix_cache_hits_total{model_name="m"} 96.0' in text
    assert 'pagedllm:kv_connector_tier_blocks_total{model_name="m",result="hit",tier="shared_storage"} 6.0' in text
    assert "External prefix cache hit rate: 96.0%" in manager.log()
