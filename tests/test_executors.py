"""Executors (plugin kind `executor`) and the Worker: the built-in `uni` runs
today's engine unchanged, a plugin's executor is selected by name, and the
`parallel` section (tensor_parallel_size, distributed_executor_backend, ...)
reads the same from every source and refuses what no executor can run."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError, UnknownComponentError
from pagedllm.engine.builder import build_engine, select_executor
from pagedllm.entrypoints.cli import build_parser, serve_config
from pagedllm.executors.base import Executor
from pagedllm.executors.mp import MultiprocExecutor
from pagedllm.executors.uni import UniProcExecutor
from pagedllm.plugins import PluginKind, RegisterFn, get_plugin_manager, hookimpl
from pagedllm.plugins.metadata import ExecutorInfo, MetadataError, build_info
from pagedllm.worker.worker import Worker

NUM_KV_BLOCKS = 32
PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 8]]


class RecordingExecutor(UniProcExecutor):
    """A third party's executor: today's one rank, every call written down."""

    calls: ClassVar[list[str]] = []

    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        self.calls.append(method)
        return super()._run_workers(method, args, kwargs)

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append("execute_model")
        return super().execute_model(scheduler_output)


class RecordingExecutorPlugin:
    @hookimpl
    def register_executors(self, register: RegisterFn) -> None:
        register("recording", RecordingExecutor, supports_tensor_parallel=False)
        register("needs_missing_pkg", RecordingExecutor, requires=["pagedllm_no_such_package"])


@pytest.fixture
def recording_executor() -> Iterator[list[str]]:
    pm = get_plugin_manager()
    pm.register(RecordingExecutorPlugin(), name="recording-executor")
    RecordingExecutor.calls = []
    yield RecordingExecutor.calls
    pm.unregister(name="recording-executor")


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _config(**flat: Any) -> EngineConfig:
    return EngineConfig.from_flat(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, **flat)


# ---- the kind and the built-in -------------------------------------------


def test_uni_is_the_builtin_executor_and_runs_one_rank() -> None:
    registry = get_plugin_manager().executors
    assert registry.kind is PluginKind.EXECUTOR
    assert registry.get("uni").info == ExecutorInfo(supports_tensor_parallel=False, requires=())
    assert registry.load("uni") is UniProcExecutor
    assert select_executor(_config(), get_plugin_manager()) is UniProcExecutor


def test_executor_metadata_refuses_unknown_keys() -> None:
    with pytest.raises(MetadataError) as info:
        build_info(ExecutorInfo, {"supports_tp": True})
    assert str(info.value).startswith("unknown metadata key 'supports_tp' (did you mean 'supports_tensor_parallel'?)")
    with pytest.raises(MetadataError, match="supports_tensor_parallel=1"):
        build_info(ExecutorInfo, {"supports_tensor_parallel": 1})


def test_build_engine_runs_the_model_through_the_uni_executor() -> None:
    parts = build_engine(_config())
    executor = parts.executor
    assert isinstance(executor, UniProcExecutor)
    assert parts.engine_core.model_executor is executor
    worker = executor.driver_worker
    assert (worker.rank, worker.local_rank, worker.distributed_init_method) == (0, 0, None)
    assert parts.num_blocks == NUM_KV_BLOCKS == executor.determine_num_kv_blocks()
    assert parts.model is worker.model_facts and parts.attn_selection is worker.attn_selection
    assert len(worker.model_runner.kv_caches) == worker.num_layers
    executor.shutdown()
    with pytest.raises(RuntimeError, match="rank 0 has been shut down"):
        worker.model_runner  # noqa: B018 - the property raises once the rank is released


def test_collective_rpc_calls_only_worker_methods() -> None:
    assert all(callable(getattr(Worker, name, None)) for name in Executor.RPC_METHODS)
    parts = build_engine(_config())
    assert parts.executor.collective_rpc("determine_num_kv_blocks") == [NUM_KV_BLOCKS]
    assert parts.executor.collective_rpc("check_health") == [None]
    with pytest.raises(ValueError, match="'__init__' is not a Worker method; allowed: check_health"):
        parts.executor.collective_rpc("__init__")
    parts.executor.shutdown()


# ---- a third party's executor -----------------------------------------------


def test_a_plugin_executor_is_selected_by_name_and_generates_the_same_tokens(
    recording_executor: list[str],
) -> None:
    expected = _greedy(LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS))
    llm = LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, distributed_executor_backend="recording")
    assert isinstance(llm.engine_core.engine_core.model_executor, RecordingExecutor)  # type: ignore[attr-defined]
    assert _greedy(llm) == expected
    assert recording_executor[:3] == ["determine_num_kv_blocks", "kv_cache_config", "initialize_cache"]
    assert recording_executor.count("execute_model") >= 8  # one step per generated token at least
    llm.shutdown()
    assert recording_executor[-1] == "shutdown"


class MinimalExecutor(Executor):
    """A third party's executor with no KV-connector code at all: one rank,
    the interface's abstract methods and nothing else."""

    def _init_executor(self) -> None:
        self.rank = Worker(self.config)
        self.rank.load_model()

    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return [getattr(self.rank, method)(*args, **kwargs)]

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.rank.execute_model(scheduler_output)

    model_facts = property(lambda self: self.rank.model_facts)  # type: ignore[assignment]
    attn_selection = property(lambda self: self.rank.attn_selection)  # type: ignore[assignment]
    platform = property(lambda self: self.rank.platform)  # type: ignore[assignment]
    device = property(lambda self: self.rank.device)  # type: ignore[assignment]


def test_an_executor_without_connector_code_runs_a_kv_connector() -> None:
    """The builder builds the connector's scheduler side and the rank its
    worker side: an executor only runs steps, whatever the connector."""
    expected = _greedy(LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS))

    class Plugin:
        @hookimpl
        def register_executors(self, register: RegisterFn) -> None:
            register("minimal", MinimalExecutor)

    pm = get_plugin_manager()
    pm.register(Plugin(), name="minimal-executor")
    try:
        # `delayed_free` (tests/plugins/pagedllm-test-plugin): the scheduler side
        # holds each finished request's blocks until the worker side reports it.
        llm = LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, distributed_executor_backend="minimal",
                  kv_transfer_config={"connector": "delayed_free"})
        assert _greedy(llm) == expected
        core = llm.engine_core.engine_core  # type: ignore[attr-defined]
        rank = core.model_executor.rank
        assert (core.kv_connector.context.side, rank.kv_connector.context.side) == ("scheduler", "worker")
        # The rank's reports came back with its step outputs: both requests' blocks freed.
        assert core.scheduler.kv_connector_stats.tier_hits["delayed"] == len(PROMPTS)
        assert core.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS
        llm.shutdown()
    finally:
        pm.unregister(name="minimal-executor")


def test_nothing_above_the_executors_reaches_into_their_ranks() -> None:
    """The engine asks its executor, never a rank (`driver_worker`): the
    connector's sides and the ranks' custom figures come the same way for
    every executor."""
    import pagedllm

    root = Path(pagedllm.__file__).parent
    offenders = sorted(
        str(path.relative_to(root))
        for folder in ("core", "engine", "entrypoints")
        for path in (root / folder).rglob("*.py")
        if "driver_worker" in path.read_text()
    )
    # The plugin template writes a model plugin's test, which may look at the rank.
    assert offenders == ["entrypoints/plugin_template.py"]


def test_a_failed_start_shuts_the_executor_down(recording_executor: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build_engine(_config(distributed_executor_backend="recording", max_model_len=NUM_KV_BLOCKS * 16 + 1))
    assert info.value.key == "model.max_model_len"
    assert recording_executor == ["determine_num_kv_blocks", "kv_cache_config", "shutdown"]


def test_an_executor_whose_package_is_missing_says_what_to_install(recording_executor: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        select_executor(_config(distributed_executor_backend="needs_missing_pkg"), get_plugin_manager())
    assert info.value.key == "parallel.distributed_executor_backend"
    assert "pip install pagedllm_no_such_package" in info.value.allowed


def test_an_unregistered_executor_lists_the_registered_names() -> None:
    with pytest.raises(UnknownComponentError, match=r"no executor named 'slurm'; registered: .*mp, .*uni"):
        select_executor(_config(distributed_executor_backend="slurm"), get_plugin_manager())


# ---- tensor_parallel_size above what the executors run ---------------------


def test_auto_picks_uni_for_one_rank_and_mp_above() -> None:
    plugin_manager = get_plugin_manager()
    assert select_executor(_config(), plugin_manager) is UniProcExecutor
    assert select_executor(_config(tensor_parallel_size=2), plugin_manager) is MultiprocExecutor


def test_tensor_parallel_with_uni_names_the_executor(recording_executor: list[str]) -> None:
    for name in ("uni", "recording"):
        with pytest.raises(ConfigError) as info:
            build_engine(_config(tensor_parallel_size=2, distributed_executor_backend=name))
        assert (info.value.key, info.value.value) == ("parallel.tensor_parallel_size", 2)
        assert info.value.allowed == (
            f"1 with executor {name!r}: it runs one rank (not registered with supports_tensor_parallel=True)"
        )
    assert recording_executor == []  # refused before any worker started


def test_llm_takes_vllm_parallel_keywords() -> None:
    with pytest.raises(ConfigError) as info:
        LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=2, distributed_executor_backend="uni")
    assert (info.value.key, info.value.value) == ("parallel.tensor_parallel_size", 2)
    llm = LLM(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=1, distributed_executor_backend="uni")
    assert isinstance(llm.engine_core.engine_core.model_executor, UniProcExecutor)  # type: ignore[attr-defined]
    assert llm.config.parallel.distributed_executor_backend == "uni"


# ---- the parallel section from every source -------------------------------


def test_parallel_defaults() -> None:
    parallel = EngineConfig().parallel
    assert parallel.model_dump() == {
        "tensor_parallel_size": 1,
        "distributed_executor_backend": "auto",
        "ray_address": None,
        "placement_strategy": "PACK",
        "master_addr": "127.0.0.1",
        "master_port": None,
        "data_parallel_size": 1,
        "data_parallel_rank": 0,
        "routing_policy": "prefix_aware",
        "enable_expert_parallel": False,
    }


def test_parallel_from_vllm_flat_names() -> None:
    config = EngineConfig.from_flat(
        model="tiny",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_address="10.0.0.1:6379",
        placement_strategy="SPREAD",
        master_port=29500,
        enable_expert_parallel=True,
    )
    assert config.parallel.model_dump() == {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
        "ray_address": "10.0.0.1:6379",
        "placement_strategy": "SPREAD",
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "data_parallel_size": 1,
        "data_parallel_rank": 0,
        "routing_policy": "prefix_aware",
        "enable_expert_parallel": True,
    }


def test_parallel_from_serve_flags_with_the_short_tp() -> None:
    for flag in ("--tensor-parallel-size", "-tp"):
        args = build_parser().parse_args(["serve", "tiny", flag, "2", "--distributed-executor-backend", "uni"])
        parallel = serve_config(args).parallel
        assert (parallel.tensor_parallel_size, parallel.distributed_executor_backend) == (2, "uni")
    args = build_parser().parse_args(["serve", "tiny", "--placement-strategy", "STRICT_PACK", "--master-port", "1234"])
    assert (serve_config(args).parallel.placement_strategy, serve_config(args).parallel.master_port) == (
        "STRICT_PACK",
        1234,
    )


def test_parallel_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("parallel:\n  tensor_parallel_size: 4\n  distributed_executor_backend: mp\n")
    config = EngineConfig.load(path)
    assert (config.parallel.tensor_parallel_size, config.parallel.distributed_executor_backend) == (4, "mp")
    monkeypatch.setenv("PAGEDLLM_PARALLEL__TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("PAGEDLLM_PARALLEL__RAY_ADDRESS", "auto")
    config = EngineConfig.load(path)  # env beats the file
    assert (config.parallel.tensor_parallel_size, config.parallel.ray_address) == (2, "auto")


@pytest.mark.parametrize(
    ("flat", "key", "allowed"),
    [
        ({"tensor_parallel_size": 0}, "parallel.tensor_parallel_size", ">= 1"),
        ({"placement_strategy": "RANDOM"}, "parallel.placement_strategy", "'STRICT_PACK', 'PACK', 'SPREAD'"),
        ({"master_port": 70000}, "parallel.master_port", ">= 1 and <= 65535"),
    ],
)
def test_parallel_values_out_of_range_name_the_field(flat: dict[str, Any], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(model="tiny", **flat)
    assert (info.value.key, info.value.allowed) == (key, allowed)
