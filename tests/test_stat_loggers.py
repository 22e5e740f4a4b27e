"""The stat-logger plugin kind: selection by `server.stat_loggers`, what a
logger receives after each step (exact values for a known run), custom
figures a KV connector attaches reaching every logger and /metrics, the
checks of their declarations, and the conformance suite on the built-ins."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import custom_stats_plugin
from helpers.custom_stats_plugin import (
    CONNECTOR_NAME,
    DRAFTER_NAME,
    LOGGER_NAME,
    CountingOffloadConnector,
    RecordingStatLogger,
)
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.custom_stats import CustomStatsCollector, MetricSpec, MetricType
from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.core.stats import IterationStats, LoRAStats, SchedulerStats
from pagedllm.engine.metrics import StatLoggerManager, stat_logger_names
from pagedllm.engine.wire import CoreOutputDecoder, CoreOutputEncoder, EngineCoreOutputs, Ready
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.cli import serve_config as cli_serve_config
from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.stat_loggers.base import (
    BUILTIN_METRIC_NAMES,
    StatLoggerBase,
    StatLoggerContext,
    validate_metric_specs,
)
from pagedllm.stat_loggers.prometheus import PrometheusStatLogger
from pagedllm.testing import ConformanceError, run_suite

BLOCK_SIZE = 16
PROMPT_A = list(range(100, 120))  # 20 tokens: one full block + 4
PROMPT_B = list(range(200, 220))
GREEDY_4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class BadNameConnector(CpuOffloadConnector):
    custom_metrics = (MetricSpec("prompt_tokens", MetricType.COUNTER, "Collides with a built-in."),)

    def get_custom_stats(self) -> dict[str, float]:
        return {}


class BrokenStatLogger(StatLoggerBase):
    """Breaks the suite's rule: it assumes every record has iteration stats."""

    def record(self, scheduler_stats: Any, iteration_stats: Any, num_scheduled_tokens: int | None = None) -> None:
        _ = iteration_stats.num_generation_tokens


class UnstartableStatLogger(StatLoggerBase):
    def __init__(self, context: StatLoggerContext) -> None:
        raise OSError("no such directory")

    def record(self, scheduler_stats: Any, iteration_stats: Any, num_scheduled_tokens: int | None = None) -> None:
        pass


class RaisingStatLogger(StatLoggerBase):
    def record(self, scheduler_stats: Any, iteration_stats: Any, num_scheduled_tokens: int | None = None) -> None:
        raise RuntimeError("boom")


class StatsTestPlugin:
    """The connector and the recording logger of helpers/custom_stats_plugin,
    plus the broken components the error tests need."""

    @hookimpl
    def register_kv_connectors(self, register: RegisterFn) -> None:
        custom_stats_plugin.register_kv_connectors(register)
        register("bad_name_connector", BadNameConnector, roles=["both"])

    @hookimpl
    def register_drafters(self, register: RegisterFn) -> None:
        custom_stats_plugin.register_drafters(register)

    @hookimpl
    def register_stat_loggers(self, register: RegisterFn) -> None:
        custom_stats_plugin.register_stat_loggers(register)
        register("broken_logger", BrokenStatLogger)
        register("raising_logger", RaisingStatLogger)
        register("unstartable_logger", UnstartableStatLogger)


@pytest.fixture(autouse=True)
def stats_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    name = pm.register(StatsTestPlugin(), name="stats-test-plugin")
    RecordingStatLogger.instances.clear()
    yield
    pm.unregister(name=name)


def _llm(**kwargs: Any) -> LLM:
    return LLM(model="tiny", dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE, **kwargs)


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(text: str, name: str, **labels: str) -> float:
    return _samples(text)[(name, frozenset({"model_name": "pagedllm-tiny", **labels}.items()))]


# ---- the kind and selection --------------------------------------------------


def test_the_builtins_are_registered_as_stat_loggers() -> None:
    registry = get_plugin_manager().stat_loggers
    assert registry.get("prometheus").source == "builtin"
    assert registry.load("prometheus") is PrometheusStatLogger
    assert registry.get("logging").target == "pagedllm.stat_loggers.log_line:LoggingStatLogger"


def test_the_server_default_is_prometheus_and_logging_and_the_config_replaces_it() -> None:
    assert stat_logger_names(EngineConfig()) == ["prometheus", "logging"]
    manager = StatLoggerManager("m", EngineConfig())
    assert list(manager.loggers) == ["prometheus", "logging"]
    chosen = EngineConfig(server={"stat_loggers": ["logging", LOGGER_NAME, "logging"]})
    manager = StatLoggerManager("m", chosen)
    assert list(manager.loggers) == ["logging", LOGGER_NAME]  # once each, in order
    assert manager.prometheus is None
    assert b"pagedllm:" not in manager.render()  # /metrics has no built-in collectors without it
    assert RecordingStatLogger.instances[-1].calls == ["log_engine_initialized"]


def test_the_stat_loggers_flag_selects() -> None:
    args = build_parser().parse_args(["serve", "--stat-loggers", f"prometheus,{LOGGER_NAME}"])
    assert cli_serve_config(args).server.stat_loggers == ["prometheus", LOGGER_NAME]


def test_an_unknown_stat_logger_is_a_config_error_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedllm.engine.llm as llm_module

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine core was started")

    monkeypatch.setattr(llm_module, "InprocClient", no_engine)
    with pytest.raises(ConfigError) as info:
        _llm(stat_loggers=["prometheus", "nope"])
    assert (info.value.key, info.value.value) == ("server.stat_loggers", "nope")
    assert info.value.allowed.startswith("registered stat loggers: ")
    assert {"logging", "prometheus", LOGGER_NAME} <= set(info.value.allowed.split(": ")[1].split(", "))


def test_serve_with_an_unknown_stat_logger_exits_naming_it() -> None:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--stat-loggers", "prometheus,nope",
               "--port", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "server.stat_loggers='nope' is invalid; allowed: registered stat loggers: " in result.stderr
    assert "EngineCore" not in result.stderr  # no engine core was started


# ---- what a logger receives --------------------------------------------------


def test_a_logger_receives_each_steps_scheduler_iteration_and_finished_stats() -> None:
    llm = _llm(stat_loggers=[LOGGER_NAME])
    llm.generate([{"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_B}], GREEDY_4, use_tqdm=False)
    [recorder] = RecordingStatLogger.instances
    records = recorder.records
    # Both 20-token prompts prefill in one step (40 tokens), then three decode
    # steps of one token each (the 4th token is sampled, never computed).
    assert [num_tokens for _, _, num_tokens in records] == [40, 2, 2, 2]
    assert [(s.num_running_reqs, s.num_waiting_reqs) for s, _, _ in records] == [(2, 0), (2, 0), (2, 0), (0, 0)]
    assert [(s.prefix_cache_queries, s.prefix_cache_hits) for s, _, _ in records] == [(40, 0), (0, 0), (0, 0), (0, 0)]
    assert [(i.num_prompt_tokens, i.num_generation_tokens) for _, i, _ in records] == [(40, 2), (0, 2), (0, 2), (0, 2)]
    assert [len(i.time_to_first_tokens) for _, i, _ in records] == [2, 0, 0, 0]
    [finished_a, finished_b] = records[-1][1].finished_requests
    for finished in (finished_a, finished_b):
        assert (finished.finish_reason, finished.num_prompt_tokens, finished.num_generation_tokens,
                finished.max_tokens_param) == ("length", 20, 4, 4)
        assert finished.decode_time == pytest.approx(finished.inference_time - finished.prefill_time)
        assert finished.e2e_latency >= finished.inference_time >= finished.decode_time >= 0

    # The same prompt again: its full first block (16 of 20 tokens) is a prefix-cache hit.
    recorder.records.clear()
    llm.generate([{"prompt_token_ids": PROMPT_A}], GREEDY_4, use_tqdm=False)
    assert (recorder.records[0][0].prefix_cache_queries, recorder.records[0][0].prefix_cache_hits) == (20, 16)
    assert recorder.records[0][2] == 4  # only the 4 uncached prompt tokens are computed
    llm.shutdown()
    assert recorder.calls[-1] == "shutdown"


def test_a_logger_that_cannot_start_is_a_plugin_error_and_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.engine.core_client import InprocClient

    shut_down = []
    monkeypatch.setattr(InprocClient, "shutdown", lambda self: shut_down.append(self))
    with pytest.raises(PluginError) as info:
        _llm(stat_loggers=["unstartable_logger"])
    assert str(info.value) == "stat logger 'unstartable_logger' failed to start: OSError: no such directory"
    assert len(shut_down) == 1


def test_a_failing_logger_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    manager = StatLoggerManager("m", EngineConfig(server={"stat_loggers": ["raising_logger", LOGGER_NAME]}))
    with caplog.at_level(logging.ERROR, logger="pagedllm.metrics"):
        manager.record(None, IterationStats(num_generation_tokens=1))
        manager.record(None, IterationStats(num_generation_tokens=2))
    assert [i.num_generation_tokens for _, i, _ in RecordingStatLogger.instances[-1].records] == [1, 2]
    assert caplog.text.count("stat logger 'raising_logger' failed in record()") == 1


# ---- custom figures ------------------------------------------------------------


def test_a_connectors_custom_figures_reach_every_logger_and_metrics() -> None:
    llm = _llm(stat_loggers=[LOGGER_NAME, "prometheus", "logging"], kv_connector=CONNECTOR_NAME)
    assert llm.engine_core.ready.custom_metrics == list(CountingOffloadConnector.custom_metrics)
    llm.generate([{"prompt_token_ids": PROMPT_A}, {"prompt_token_ids": PROMPT_B}], GREEDY_4, use_tqdm=False)
    [recorder] = RecordingStatLogger.instances
    assert recorder.context.custom_metrics == CountingOffloadConnector.custom_metrics
    figures = [s.custom_stats for s, _, _ in recorder.records]
    # Nothing finished until the last step; then each request held 2 blocks
    # (20 prompt + 3 computed tokens = 23 slots of 16).
    assert figures[:-1] == [{"blocks_saved": 0.0, "last_finished_blocks": 0.0, "blocks_per_finished_request": []}] * 3
    assert figures[-1] == {"blocks_saved": 4.0, "last_finished_blocks": 2.0, "blocks_per_finished_request": [2.0, 2.0]}

    assert llm.stat_logger is not None
    text = llm.stat_logger.render().decode()
    assert _value(text, "pagedllm:blocks_saved_total") == 4.0
    assert _value(text, "pagedllm:last_finished_blocks") == 2.0
    assert _value(text, "pagedllm:blocks_per_finished_request_count") == 2.0
    assert _value(text, "pagedllm:blocks_per_finished_request_sum") == 4.0
    assert _value(text, "pagedllm:blocks_per_finished_request_bucket", le="1.0") == 0.0
    assert _value(text, "pagedllm:blocks_per_finished_request_bucket", le="2.0") == 2.0
    assert "# HELP pagedllm:blocks_saved_total KV blocks held by finished requests." in text
    line = llm.stat_logger.log()
    assert line.endswith(", blocks_saved: 4, last_finished_blocks: 2, blocks_per_finished_request: 2 obs, mean 2")
    llm.shutdown()


def test_a_drafters_custom_figure_equals_the_draft_tokens_the_scheduler_verified() -> None:
    # A repetitive prompt, so that n-gram lookup finds drafts to propose.
    prompt = [5, 6, 7, 8] * 6
    llm = _llm(stat_loggers=[LOGGER_NAME], speculative_method=DRAFTER_NAME, num_speculative_tokens=3)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    records = RecordingStatLogger.instances[-1].records
    proposed = [s.custom_stats["draft_tokens_proposed"] for s, _, _ in records]
    verified = [s.spec_decoding_stats.num_draft_tokens for s, _, _ in records]
    assert sum(proposed) == llm.engine_core.executor.driver_worker.drafter.proposed > 0
    # What a step proposes, the next step schedules (1 + drafts) and verifies;
    # the last step's proposals die with the finished request.
    assert verified[0] == 0 and verified[1:] == proposed[:-1]
    assert [num_tokens for _, _, num_tokens in records][1:] == [1 + drafts for drafts in proposed[:-1]]


def test_a_drafter_on_a_rank_process_sends_its_figures_with_the_step_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executor `mp`: the drafter runs in the rank's process; its figures
    come back with each step's output, the same per step as in-process
    (policy `always`: the default one drafts by measured step times, which
    differ between the two runs)."""
    # The rank processes load the plugin through its entry point (this
    # process has it registered by the fixture).
    site = custom_stats_plugin.write_plugin_site(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    per_step = []
    for executor in ("uni", "mp"):
        llm = _llm(stat_loggers=[LOGGER_NAME], speculative_method=DRAFTER_NAME, num_speculative_tokens=3,
                   speculative_policy="always", distributed_executor_backend=executor)
        try:
            assert [spec.name for spec in llm.engine_core.ready.custom_metrics] == ["draft_tokens_proposed"]
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        finally:
            llm.shutdown()
        records = RecordingStatLogger.instances[-1].records
        per_step.append([(s.custom_stats or {}).get("draft_tokens_proposed") for s, _, _ in records])
    uni, mp = per_step
    assert mp == uni and sum(uni) > 0


def test_custom_stats_travel_on_the_wire() -> None:
    stats = SchedulerStats(1, 0, 0.5, 0, 0, 0, custom_stats={"blocks_saved": 3.0, "sizes": [1.0, 2.5]})
    message = EngineCoreOutputs([], stats, 7, 1.0)
    decoded = CoreOutputDecoder().decode(CoreOutputEncoder().encode(message))
    assert isinstance(decoded, EngineCoreOutputs)
    assert decoded.scheduler_stats == stats
    spec = MetricSpec("sizes", MetricType.HISTOGRAM, "Sizes.", buckets=[1.0, 2.0])
    ready = Ready(1, "/m", 64, 100, 8, 16, None, "torch_native", "uni", 1, "gloo", custom_metrics=[spec])
    decoded_ready = CoreOutputDecoder().decode(CoreOutputEncoder().encode(ready))
    assert isinstance(decoded_ready, Ready) and decoded_ready.custom_metrics == [spec]


class _Source:
    def __init__(self, *specs: MetricSpec) -> None:
        self.custom_metrics = specs
        self.report: dict[str, Any] = {}

    def get_custom_stats(self) -> dict[str, Any]:
        return self.report


COUNTER = MetricSpec("saved", MetricType.COUNTER, "Saved.")
GAUGE = MetricSpec("queue", MetricType.GAUGE, "Queue.")
HISTOGRAM = MetricSpec("sizes", MetricType.HISTOGRAM, "Sizes.")


def test_the_collector_sends_counter_increases_gauges_and_new_observations() -> None:
    first, second = _Source(COUNTER, GAUGE, HISTOGRAM), _Source(COUNTER, GAUGE)
    collector = CustomStatsCollector([("first", first), ("second", second)])
    assert collector.take() is None  # nothing reported
    first.report = {"saved": 5, "queue": 2, "sizes": [1, 2]}
    second.report = {"saved": 1, "queue": 3}
    assert collector.take() == {"saved": 6.0, "queue": 5.0, "sizes": [1.0, 2.0]}
    first.report = {"saved": 7, "queue": 0, "sizes": []}
    assert collector.take() == {"saved": 2.0, "queue": 3.0, "sizes": []}
    first.report = {"saved": 3}  # a smaller total: the component started over
    second.report = {}
    assert collector.take() == {"saved": 3.0}


def test_the_collector_leaves_out_undeclared_and_ill_typed_figures(caplog: pytest.LogCaptureFixture) -> None:
    source = _Source(COUNTER, GAUGE, HISTOGRAM)
    collector = CustomStatsCollector([("kv_connector 'x'", source)])
    source.report = {"saved": -1, "queue": "full", "sizes": 3, "other": 1.0}
    with caplog.at_level(logging.ERROR, logger="pagedllm.core.custom_stats"):
        assert collector.take() is None
        assert collector.take() is None
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 4  # once each, not once per step
    assert "custom figure 'other' of kv_connector 'x' left out: it reports a figure it did not declare" in messages[3]
    assert messages[0] == ("custom figure 'saved' of kv_connector 'x' left out: a counter needs a finite "
                           "number >= 0 (its total since start), got -1")


@pytest.mark.parametrize(
    ("spec", "key", "allowed"),
    [
        (MetricSpec("blocks-saved", MetricType.COUNTER, "x"), "c.custom_metrics",
         "a Prometheus metric name: [a-zA-Z_][a-zA-Z0-9_]*, at most 128 characters (exposed as pagedllm:<name>)"),
        (MetricSpec("prompt_tokens", MetricType.COUNTER, "x"), "c.custom_metrics",
         "a name no built-in metric has (pagedllm:prompt_tokens is built in)"),
        (MetricSpec("saved_total", MetricType.COUNTER, "x"), "c.custom_metrics",
         "a name not ending in _total, _bucket, _sum, _count, _created, _info (the exposition adds those)"),
        (MetricSpec("saved", "summary", "x"), "c.custom_metrics.saved.type",  # type: ignore[arg-type]
         "'counter', 'gauge', 'histogram'"),
        (MetricSpec("saved", MetricType.GAUGE, " "), "c.custom_metrics.saved.help", "a non-empty help text"),
        (MetricSpec("saved", MetricType.GAUGE, "x", buckets=[1.0]), "c.custom_metrics.saved.buckets",
         "None: only a histogram has buckets"),
        (MetricSpec("saved", MetricType.HISTOGRAM, "x", buckets=[2.0, 1.0]), "c.custom_metrics.saved.buckets",
         "a non-empty, strictly ascending list"),
    ],
)
def test_a_bad_declaration_is_a_config_error_naming_the_rule(spec: MetricSpec, key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_metric_specs([("c", [spec])])
    assert (info.value.key, info.value.allowed) == (key, allowed)


def test_one_name_declared_differently_by_two_components_is_an_error() -> None:
    other = MetricSpec("saved", MetricType.GAUGE, "Saved.")
    assert validate_metric_specs([("a", [COUNTER]), ("b", [COUNTER])]) == [COUNTER]  # the same figure
    with pytest.raises(ConfigError) as info:
        validate_metric_specs([("drafter 'x'", [COUNTER]), ("kv_connector 'y'", [other])])
    assert str(info.value) == (
        "kv_connector 'y'.custom_metrics='saved' is invalid; allowed: a name no other component declares "
        f"(drafter 'x' declares 'saved' as {COUNTER!r})"
    )


def test_an_engine_whose_connector_declares_a_builtin_name_does_not_start() -> None:
    with pytest.raises(ConfigError) as info:
        _llm(kv_connector="bad_name_connector")
    assert info.value.key == "kv_connector 'bad_name_connector'.custom_metrics"
    assert info.value.value == "prompt_tokens"


def test_the_builtin_metric_names_are_exactly_what_prometheus_registers() -> None:
    registry = CollectorRegistry(auto_describe=True)
    context = StatLoggerContext("m", EngineConfig(), registry, 1024)
    prometheus = PrometheusStatLogger(context)
    prometheus.log_engine_initialized()
    prometheus.add_router_metrics(2)
    prometheus.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, lora_stats=LoRAStats(max_lora=1)), None)
    names = {metric.name.removeprefix("pagedllm:") for metric in registry.collect()}
    assert names == BUILTIN_METRIC_NAMES


def test_lora_stats_become_per_adapter_counters_and_vllms_info_gauge() -> None:
    registry = CollectorRegistry()
    prometheus = PrometheusStatLogger(StatLoggerContext("m", EngineConfig(), registry, 1024))
    no_lora = SchedulerStats(1, 0, 0.0, 0, 0, 0)
    prometheus.record(no_lora, None)
    assert registry.get_sample_value("pagedllm:lora_adapters_loaded", {"model_name": "m"}) is None
    for requests in ({"sql": 2, "fr": 1}, {"sql": 1}):
        lora = LoRAStats(
            max_lora=4, running_lora_adapters=["fr", "sql"], waiting_lora_adapters=["de"], num_loaded_adapters=3,
            load_times_s=[0.2], requests=requests, prompt_tokens={"sql": 10}, generation_tokens={"fr": 4},
        )
        prometheus.record(SchedulerStats(1, 0, 0.0, 0, 0, 0, lora_stats=lora), None)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value("pagedllm:" + name, {"model_name": "m", **labels})

    assert value("lora_requests_total", lora_name="sql") == 3.0
    assert value("lora_requests_total", lora_name="fr") == 1.0
    assert value("lora_prompt_tokens_total", lora_name="sql") == 20.0
    assert value("lora_generation_tokens_total", lora_name="fr") == 8.0
    assert value("lora_adapters_loaded") == 3.0
    assert value("lora_load_time_seconds_count") == 2.0
    info = next(s for s in registry.collect() if s.name == "pagedllm:lora_requests_info").samples
    assert [sample.labels for sample in info] == [{
        "model_name": "m", "max_lora": "4", "waiting_lora_adapters": "de", "running_lora_adapters": "fr,sql",
    }]


# ---- conformance ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["prometheus", "logging", LOGGER_NAME])
def test_the_stat_loggers_pass_their_conformance_suite(name: str) -> None:
    run_suite("stat_logger", name)


def test_a_logger_that_assumes_iteration_stats_fails_the_named_rule() -> None:
    with pytest.raises(ConformanceError) as info:
        run_suite("stat_logger", "broken_logger")
    assert info.value.rule == "records-every-stats-shape"
    assert "record() of an idle heartbeat (no outputs, 0 tokens) raised AttributeError" in str(info.value)
