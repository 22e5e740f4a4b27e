"""The `ray` executor: one Ray actor per rank in a placement group. TP=2 on
a local Ray it starts, and on a two-node cluster on this machine (one rank
per node), gives TP=1's greedy tokens, also with a KV connector moving each
rank's shard; a killed rank fails the engine naming it; nothing of Ray's
that a test started outlives it. Without Ray installed, selecting it says
how to install it."""

from __future__ import annotations

import os

# NOTE: before Ray is imported anywhere: Ray then binds 127.0.0.1 only (no
# traffic leaves the machine) and sends no usage report.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import importlib.util
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.core.scheduler_output import KVConnectorStats
from pagedllm.distributed.utils import get_open_port
from pagedllm.engine.builder import select_executor
from pagedllm.executors.base import RankFailedError
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from pagedllm.executors.ray_executor import RayExecutor

# Ray is part of the test environment (`make install`: .[dev,ray]): these
# tests run everywhere the suite does; a missing Ray fails them, not skips them.
NUM_KV_BLOCKS = 64
PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
# Generous: the ranks import torch and load the model on two shared cores.
DEADLINE_S = 60.0
# The smallest object store Ray accepts: the frames are small.
OBJECT_STORE_BYTES = 80 * 1024 * 1024


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _executor(llm: LLM) -> RayExecutor:
    from pagedllm.executors.ray_executor import RayExecutor

    executor = llm.engine_core.executor  # type: ignore[attr-defined]
    assert isinstance(executor, RayExecutor)
    return executor


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S:.0f} s: {what}")
        time.sleep(0.1)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited; it only waits for its parent to reap it.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _assert_gone(pids: set[int], what: str) -> None:
    for pid in sorted(pids):
        _wait_until(lambda pid=pid: _process_gone(pid), f"{what} (pid {pid}) exits")


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    """TP=1 on the in-process `uni` executor. float32 throughout: in bfloat16
    (the default where the CPU computes it natively) TP=2's partial sums
    round differently enough to flip a near-tie."""
    llm = LLM("tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    try:
        return _greedy(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Cluster]:
    """A head and a second node (custom resource `node2`) on this machine,
    two CPUs each, so only SPREAD puts one rank on each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node2": 1}, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


# ---- end to end ------------------------------------------------------------


@pytest.mark.slow
def test_tp2_on_a_local_ray_it_starts_gives_tp1_tokens(
    reference_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = _descendants(os.getpid())
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=NUM_KV_BLOCKS)
    try:
        assert _greedy(llm) == reference_tokens
        placements = _executor(llm).rank_placements
        assert len({placement.node_id for placement in placements}) == 1
        started = _descendants(os.getpid()) - before
        assert {placement.pid for placement in placements} <= started
    finally:
        llm.shutdown()
    # The executor started this Ray, so it stopped it: its servers, agents and actors.
    assert not ray.is_initialized()
    _assert_gone(started, "a process of the local Ray")


@pytest.mark.slow
def test_two_node_cluster_places_one_rank_on_each_node(
    two_node_cluster: Cluster, reference_tokens: list[list[int]]
) -> None:
    import ray

    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=NUM_KV_BLOCKS, ray_address=two_node_cluster.address, placement_strategy="SPREAD")
    try:
        assert _greedy(llm) == reference_tokens
        rank_nodes = [placement.node_id for placement in _executor(llm).rank_placements]
        nodes = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        assert sorted(rank_nodes) == sorted(nodes)
        assert sum("node2" in nodes[node_id] for node_id in rank_nodes) == 1
    finally:
        llm.shutdown()
    # Attached, not started: the session ends, the cluster stays.
    assert not ray.is_initialized()
    assert two_node_cluster.head_node.remaining_processes_alive()


def _offload_workload(llm: LLM) -> tuple[list[list[int]], list[int], Any]:
    """Three 3-block prefixes cycled one request at a time through a 10-block
    pool over a 4-block CPU tier: spills, loads and drops."""
    import random

    rng = random.Random(5)
    shared = [[rng.randrange(10, 4000) for _ in range(48)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = [llm.generate([{"prompt_token_ids": shared[i % 3] + [20 + i]}], params, use_tqdm=False)[0]
               for i in range(9)]
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks  # every delayed free done
    return ([list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs],
            core.scheduler.kv_connector_stats)


@pytest.mark.slow
def test_a_kv_connector_across_two_nodes_moves_each_ranks_shard_as_tp1_moves_whole_blocks(
    two_node_cluster: Cluster,
) -> None:
    """`delayed_free` (the CPU tier, each finished request's blocks kept until
    every rank reports): its metadata reaches both actors, both report, and
    TP=2 gives TP=1's tokens, hits and bytes (cpu_bytes is per rank: half)."""
    block_bytes = 6 * 2 * 16 * 2 * 64 * 4  # tiny: 6 layers, 2 KV heads of 64, float32

    def transfer(tp_size: int) -> dict[str, Any]:
        return {"connector": "delayed_free", "extra": {"cpu_bytes": 4 * block_bytes // tp_size}}

    uni = LLM("tiny", dtype="float32", num_kv_blocks=10, kv_transfer_config=transfer(1))
    try:
        expected = _offload_workload(uni)
    finally:
        uni.shutdown()
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray", num_kv_blocks=10,
              ray_address=two_node_cluster.address, placement_strategy="SPREAD", kv_transfer_config=transfer(2))
    try:
        tokens, cached, stats = _offload_workload(llm)
    finally:
        llm.shutdown()
    assert (tokens, cached) == expected[:2]
    assert stats.tier_hits["cpu"] > 0 and stats.tier_hits["delayed"] == 2 * 9  # both ranks, every request
    assert stats == KVConnectorStats(**{**vars(expected[2]), "tier_hits": {**expected[2].tier_hits,
                                                                           "delayed": 2 * 9}})


@pytest.mark.slow
def test_a_killed_rank_fails_the_engine_naming_it_and_leaves_nothing_behind(two_node_cluster: Cluster) -> None:
    import ray

    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=NUM_KV_BLOCKS, ray_address=two_node_cluster.address)
    try:
        executor = _executor(llm)
        placements = executor.rank_placements
        _greedy(llm)
        # What the kernel's out-of-memory killer does.
        os.kill(placements[1].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError) as failed:
            _greedy(llm)
        assert failed.value.rank == 1
        assert failed.value.cause.startswith("Ray actor lost: ")
        # Every later call fails at once with the same error.
        with pytest.raises(RankFailedError) as again:
            executor.check_health()
        assert again.value is failed.value
        with pytest.raises(RankFailedError) as again:
            _greedy(llm)
        assert again.value is failed.value
    finally:
        llm.shutdown()
    llm.shutdown()  # safe twice
    _assert_gone({placement.pid for placement in placements}, "a rank's actor")
    ray.init(address=two_node_cluster.address)
    try:
        # The placement group is gone: every CPU of the cluster is free again.
        _wait_until(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"],
                    "the placement group's CPUs are free")
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_rank_lost_while_idle_fails_the_health_check(two_node_cluster: Cluster) -> None:
    """What the engine core's idle poll sees (no step in flight to notice it)."""
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=NUM_KV_BLOCKS, ray_address=two_node_cluster.address)
    try:
        executor = _executor(llm)
        executor.check_health()
        os.kill(executor.rank_placements[0].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError) as failed:
            executor.check_health()
        assert (failed.value.rank, failed.value.cause.split(":")[0]) == (0, "Ray actor lost")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_placement_the_cluster_can_never_hold_is_a_config_error(two_node_cluster: Cluster) -> None:
    import ray

    with pytest.raises(ConfigError) as info:
        LLM("tiny", tensor_parallel_size=4, distributed_executor_backend="ray", num_kv_blocks=NUM_KV_BLOCKS,
            ray_address=two_node_cluster.address, placement_strategy="STRICT_PACK")
    assert info.value.key == "parallel.tensor_parallel_size"
    assert "4 bundles of {'CPU': 1.0} placed STRICT_PACK" in info.value.allowed
    assert "[{'CPU': 2.0}, {'CPU': 2.0}]" in info.value.allowed
    assert not ray.is_initialized()


def test_a_ray_address_where_nothing_listens_is_a_config_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    address = f"127.0.0.1:{get_open_port()}"  # free a moment ago: nothing listens there
    with pytest.raises(ConfigError) as info:
        LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=address)
    assert (info.value.key, info.value.value) == ("parallel.ray_address", address)
    assert "`ray start --head` prints it" in info.value.allowed
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConfigError) as info:
        LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
    assert (info.value.key, info.value.value) == ("RAY_ADDRESS", address)
    assert not ray.is_initialized()


# ---- units -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "num_bundles", "fits"),
    [("STRICT_PACK", 2, True), ("STRICT_PACK", 3, False), ("PACK", 4, True), ("SPREAD", 5, False)],
)
def test_placement_fits_counts_whole_bundles_per_node(strategy: str, num_bundles: int, fits: bool) -> None:
    from pagedllm.executors.ray_utils import placement_fits

    nodes = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 2.5}, {"GPU": 8.0}]
    assert placement_fits(nodes, {"CPU": 1.0}, num_bundles, strategy) is fits


def test_local_ranks_index_each_nodes_gpus_or_count_its_ranks() -> None:
    from pagedllm.executors.ray_utils import RankPlacement, assign_local_ranks

    def on(node_id: str, *gpu_ids: str) -> RankPlacement:
        return RankPlacement(node_id, "10.0.0.1", 1, list(gpu_ids), 1)

    assert assign_local_ranks([on("a", "3"), on("a", "10"), on("b", "0"), on("a", "2")]) == (
        [1, 2, 0, 0], {"a": ["2", "3", "10"], "b": ["0"]}
    )
    assert assign_local_ranks([on("a"), on("b"), on("a")]) == ([0, 0, 1], {"a": [], "b": []})


def test_selecting_ray_without_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "ray" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    config = EngineConfig.from_flat(model="tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ConfigError) as info:
        select_executor(config, get_plugin_manager())
    assert info.value.key == "parallel.distributed_executor_backend"
    assert info.value.value == "ray"
    assert "pip install 'pagedllm[ray]'" in info.value.allowed


@pytest.mark.slow
def test_every_ray_rank_builds_the_plugin_options_of_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin's options (plugins.config) travel in the EngineConfig to each
    actor, which validates them when it loads the plugins: the test plugin's
    backend on both ranks records the same options (tests/test_plugin_config.py)."""
    import json

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    record = tmp_path / "record.jsonl"
    options = {"record_path": str(record), "label": "ray", "scale": 5, "tiers": [3]}
    llm = LLM("tiny", dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              num_kv_blocks=NUM_KV_BLOCKS, attention_backend="test_echo",
              plugin_config={"pagedllm_test_plugin": options})
    try:
        rank_pids = {placement.pid for placement in _executor(llm).rank_placements}
    finally:
        llm.shutdown()
        get_plugin_manager().load(config={})
    records = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["pid"] for r in records} == rank_pids and len(rank_pids) == 2
    expected = {"record_path": str(record), "label": "ray", "scale": 5, "mode": "exact", "tiers": [3]}
    assert all(r["options"] == expected for r in records)
