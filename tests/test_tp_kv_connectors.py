"""KV connectors at tensor_parallel_size 2 (issue 15): the scheduler side
runs in the engine's process, a worker side on every rank, and each rank
stores and loads its own shard of every block (its KV heads).

- shared_storage: a TP=2 producer writes one file per rank per block, in a
  directory per rank, whose halves put together are TP=1's block; a TP=2
  consumer loads them and gives TP=1's tokens; a TP=2 consumer never loads
  blocks a TP=1 producer stored;
- cpu_offload: under eviction and a tier too small to keep everything, TP=2
  gives TP=1's tokens, hits and bytes moved (the ranks' tiers follow the
  scheduler side's index: a block it thinks is there and a rank lacks fails
  the step);
- the delayed-free contract: blocks of a finished request stay allocated
  until every rank has reported its save done (at TP=1: its one rank);
- the plumbing: connector metadata crosses to the ranks as msgpack of its
  dataclass (tensors are refused with a clear error), the ranks' reports
  are merged (a request is done when every rank says so; counts summed).

Reference tokens come from a plain TP=1 engine in the same test; float32.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler_output import KVConnectorOutput, KVConnectorStats, SchedulerOutput
from pagedllm.executors.kv_output_aggregator import KVOutputAggregator
from pagedllm.executors.messages import ExecuteModel, WorkerInputDecoder, encode_step
from pagedllm.kv_connectors.cpu_offload import CpuOffloadMetadata
from pagedllm.kv_connectors.shared_storage import SharedStorageMetadata, read_block

BLOCK = 16
COMMON: dict[str, Any] = dict(model="tiny", dtype="float32")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# The shipped tiny model: 6 layers, 2 KV heads of 64 (one per rank at TP=2).
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 64
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK * NUM_KV_HEADS * HEAD_SIZE * 4  # every layer's K and V, float32


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    torch.set_num_threads(1)


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(num)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@contextmanager
def _engine(tensor_parallel_size: int, **kwargs: Any) -> Iterator[LLM]:
    llm = LLM(**COMMON, tensor_parallel_size=tensor_parallel_size, **kwargs)
    try:
        yield llm
    finally:
        llm.shutdown()


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    with _engine(1, num_kv_blocks=128) as llm:
        return _tokens(_generate(llm, prompts))


def _core(llm: LLM) -> Any:
    return llm.engine_core.engine_core  # type: ignore[attr-defined]


def _stats(llm: LLM) -> KVConnectorStats:
    stats = _core(llm).scheduler.kv_connector_stats
    assert stats is not None
    return stats


def _assert_no_block_leak(llm: LLM) -> None:
    manager = _core(llm).kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants([])


def _storage(path: Path, role: str) -> dict[str, Any]:
    return {"connector": "shared_storage", "role": role, "extra": {"path": str(path)}}


# ------------------------------------------------------------ the plumbing


def _step(metadata: Any) -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0, kv_connector_metadata=metadata)


def test_connector_metadata_crosses_to_the_ranks_as_its_dataclass() -> None:
    storage = SharedStorageMetadata(loads=[(3, b"\x01" * 8)], saves=[(5, b"\x02" * 8), (6, b"\x03" * 8)])
    offload = CpuOffloadMetadata(spills=[(1, b"a")], loads=[(2, b"b")], drops=[b"c", b"d"])
    for metadata in (storage, offload):
        decoded = _decoded_step(_step(metadata), type(metadata)).kv_connector_metadata
        assert type(decoded) is type(metadata) and decoded == metadata
    assert _decoded_step(_step(None), None).kv_connector_metadata is None


def _decoded_step(step: SchedulerOutput, metadata_cls: Any) -> SchedulerOutput:
    message = WorkerInputDecoder(lambda: metadata_cls).decode(encode_step(step))
    assert isinstance(message, ExecuteModel)
    return message.step


def test_metadata_holding_tensors_is_refused_with_a_clear_error() -> None:
    from dataclasses import dataclass, field

    from pagedllm.kv_connectors.base import KVConnectorMetadata

    @dataclass
    class TensorMetadata(KVConnectorMetadata):
        loads: list[Any] = field(default_factory=list)

    refused = r"KV connector metadata TensorMetadata cannot be sent to the ranks .*no tensors"
    with pytest.raises(TypeError, match=refused):
        encode_step(_step(TensorMetadata(loads=[torch.zeros(2)])))


def test_a_request_is_done_when_every_rank_has_reported_it_and_counts_add_up() -> None:
    aggregator = KVOutputAggregator(world_size=2)

    def report(sending: set[str], hits: int) -> KVConnectorOutput:
        stats = KVConnectorStats(tier_bytes_saved={"t": hits}, external_hits=hits)
        return KVConnectorOutput(finished_sending=sending, stats=stats)

    first = aggregator.merge([report({"a", "b"}, 3), report({"b"}, 4)])
    assert first.finished_sending == {"b"}  # a: rank 1 has not said so yet
    assert first.stats == KVConnectorStats(external_hits=7, tier_bytes_saved={"t": 7})
    second = aggregator.merge([report(set(), 0), None])  # a rank without a report
    assert second.finished_sending == set()
    third = aggregator.merge([report(set(), 1), report({"a"}, 1)])
    assert third.finished_sending == {"a"} and third.stats is not None and third.stats.external_hits == 2
    assert aggregator.merge([report({"a"}, 0), report(set(), 0)]).finished_sending == set()  # a new round for "a"


# ------------------------------------------------------- delayed free


@pytest.mark.parametrize(
    ("executor", "tp_size", "held_steps"),
    [("uni", 1, 2), pytest.param("mp", 2, 4, marks=pytest.mark.slow)],
)
def test_blocks_stay_allocated_until_every_rank_reports_the_save_done(
    executor: str, tp_size: int, held_steps: int
) -> None:
    """`delayed_free` (tests/plugins/pagedllm-test-plugin): rank r reports a
    finished request 1 + 2r steps after it learned of it, which is the step
    after the request finished: held for 2 steps at TP=1 (the finishing
    step's and one more), 4 at TP=2 (rank 1's)."""
    prompt = _prompts(1, 2 * BLOCK + 3, seed=21)
    expected = _reference(prompt)
    kv_transfer_config = {"connector": "delayed_free"}
    with _engine(tp_size, num_kv_blocks=32, distributed_executor_backend=executor,
                 kv_transfer_config=kv_transfer_config) as llm:
        core = _core(llm)
        held: list[int] = []
        step = core.step

        def traced_step() -> Any:
            outputs = step()
            held.append(len(core.scheduler.kv_transfer.delayed_free))
            return outputs

        core.step = traced_step
        assert _tokens(_generate(llm, prompt)) == expected
        assert held.count(1) == held_steps and held[-1] == 0
        assert held[-held_steps - 1 :] == [1] * held_steps + [0]
        # Every rank reported the request once (the worker sides' counts, summed).
        assert _stats(llm).tier_hits["delayed"] == tp_size
        _assert_no_block_leak(llm)


# ------------------------------------------------------------ shared storage


def _block_files(directory: Path) -> dict[str, Path]:
    return {path.name: path for path in directory.glob("*.safetensors")}


@pytest.mark.slow
def test_a_tp2_producer_stores_each_ranks_shard_and_a_tp2_consumer_loads_them(tmp_path: Path) -> None:
    prompts = _prompts(2, 4 * BLOCK + 5, seed=3)  # 4 full prompt blocks each
    expected = _reference(prompts)
    with _engine(1, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path / "tp1", "producer")) as producer:
        assert _tokens(_generate(producer, prompts)) == expected
    with _engine(2, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path / "tp2", "producer")) as producer:
        assert _tokens(_generate(producer, prompts)) == expected
        assert _stats(producer).tier_bytes_saved["shared_storage"] > 8 * BLOCK_BYTES  # both ranks' files

    [tp1_dir] = (tmp_path / "tp1").iterdir()
    rank_dirs = [tmp_path / "tp2" / fingerprint for fingerprint in _rank_fingerprints(tmp_path / "tp2")]
    tp1_files = _block_files(tp1_dir)
    assert len(tp1_files) == 8 and tp1_dir.name not in {d.name for d in rank_dirs}
    for rank_dir in rank_dirs:
        assert _block_files(rank_dir).keys() == tp1_files.keys()  # the same blocks, by content hash
    for name, path in tp1_files.items():
        whole = read_block(path, (NUM_LAYERS, 2, BLOCK, NUM_KV_HEADS, HEAD_SIZE), torch.float32)
        shards = [read_block(d / name, (NUM_LAYERS, 2, BLOCK, 1, HEAD_SIZE), torch.float32) for d in rank_dirs]
        # Rank r holds KV head r: its half of TP=1's block (up to the all-reduces' summation order).
        torch.testing.assert_close(torch.cat(shards, dim=3), whole, rtol=1e-3, atol=2e-4)

    consumer_config = _storage(tmp_path / "tp2", "consumer")
    with _engine(2, num_kv_blocks=64, enable_prefix_caching=False, kv_transfer_config=consumer_config) as consumer:
        outputs = _generate(consumer, prompts)
        assert _tokens(outputs) == expected
        assert [o.num_cached_tokens for o in outputs] == [4 * BLOCK, 4 * BLOCK]
        stats = _stats(consumer)
        assert (stats.external_hits, stats.tier_hits["shared_storage"]) == (8 * BLOCK, 8)
        assert stats.tier_bytes_loaded["shared_storage"] == 8 * BLOCK_BYTES  # both halves of 8 blocks
        _assert_no_block_leak(consumer)


def _rank_fingerprints(path: Path) -> list[str]:
    """The TP=2 ranks' directory names, in rank order (as the engine names them)."""
    from pagedllm.kv_connectors.base import model_fingerprint
    from pagedllm.model_registry.model_source import resolve_model_path
    from pagedllm.plugins import get_plugin_manager

    model_path = resolve_model_path("tiny", get_plugin_manager())
    names = [model_fingerprint(model_path, torch.float32, BLOCK, NUM_LAYERS, 1, HEAD_SIZE, tp_size=2, tp_rank=rank)
             for rank in (0, 1)]
    assert sorted(names) == sorted(d.name for d in path.iterdir())
    return names


@pytest.mark.slow
def test_a_tp2_consumer_never_loads_blocks_a_tp1_producer_stored(tmp_path: Path) -> None:
    prompts = _prompts(2, 3 * BLOCK + 2, seed=8)
    expected = _reference(prompts)
    with _engine(1, num_kv_blocks=64, kv_transfer_config=_storage(tmp_path, "producer")) as producer:
        _generate(producer, prompts)
    with _engine(2, num_kv_blocks=64, enable_prefix_caching=False,
                 kv_transfer_config=_storage(tmp_path, "consumer")) as consumer:
        outputs = _generate(consumer, prompts)
        assert _tokens(outputs) == expected
        assert [o.num_cached_tokens for o in outputs] == [0, 0]
        stats = _stats(consumer)
        assert (stats.external_hits, stats.load_failures) == (0, 0)


# --------------------------------------------------------------- CPU offload


def _offload_run(tp_size: int, prompts: list[list[int]], cpu_blocks: int) -> tuple[list[Any], KVConnectorStats]:
    # cpu_bytes is per rank: at TP=2 a rank's share of a block is half of one.
    transfer = {"connector": "cpu_offload", "extra": {"cpu_bytes": cpu_blocks * BLOCK_BYTES // tp_size}}
    with _engine(tp_size, num_kv_blocks=10, kv_transfer_config=transfer) as llm:
        outputs = [_generate(llm, [prompt])[0] for prompt in prompts]  # one at a time: the pool cycles
        _assert_no_block_leak(llm)
        return outputs, _stats(llm)


@pytest.mark.slow
def test_cpu_offload_at_tp2_hits_moves_and_drops_blocks_as_at_tp1() -> None:
    """Four 3-block prefixes cycled through a 10-block pool and a 6-block
    tier: blocks are spilled, loaded back and dropped from the tier, the
    same ones at TP=2 as at TP=1."""
    shared = _prompts(4, 3 * BLOCK, seed=30)
    prompts = [shared[i % 4] + _prompts(1, 5, seed=100 + i)[0] for i in range(12)]
    expected = _reference(prompts)
    tp1_outputs, tp1_stats = _offload_run(1, prompts, cpu_blocks=6)
    tp2_outputs, tp2_stats = _offload_run(2, prompts, cpu_blocks=6)
    assert _tokens(tp1_outputs) == _tokens(tp2_outputs) == expected
    assert [o.num_cached_tokens for o in tp2_outputs] == [o.num_cached_tokens for o in tp1_outputs]
    assert tp1_stats.tier_hits["cpu"] > 0 and tp1_stats.tier_misses["cpu"] > 0  # the tier both hit and missed
    # The bytes are summed over the ranks: two halves of every block moved.
    assert tp2_stats == tp1_stats
    assert tp2_stats.tier_bytes_loaded["cpu"] == tp2_stats.tier_hits["cpu"] * BLOCK_BYTES
