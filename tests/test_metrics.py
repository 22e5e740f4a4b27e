"""Metrics: IterationStats from the OutputProcessor, Prometheus exposition of
StatLoggerManager, the periodic log line and the Grafana dashboard.

Timestamps are chosen exactly representable in binary (x.0, x.25, x.5, ...)
so every latency, sum and bucket count can be compared with ==.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.core.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.stats import FinishedRequestStats, IterationStats, SchedulerStats
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, StatLoggerManager, build_1_2_5_buckets
from pagedllm.engine.output_processor import OutputProcessor

MODEL = "tiny-model"
LABEL = {"model_name": MODEL}
DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "pagedllm-dashboard.json"


def add(processor, request_id, prompt, prompt_token_ids, params, arrival_time=None, output_kind=None):
    """Track a request as a front end does: fanned out by the input processor."""
    request = make_request(request_id, prompt, prompt_token_ids, params, arrival_time)
    processor.add_request(request, output_kind)
    return request

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"]
COUNTERS = [
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
    "request_success",
]  # fmt: skip
HISTOGRAMS = [
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_params_max_tokens", "request_params_n", "iteration_tokens_total",
]  # fmt: skip


def scrape(manager: StatLoggerManager) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """sample name + labels -> value, from the rendered exposition text."""
    samples = {}
    for family in text_string_to_metric_families(manager.render().decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[("pagedllm:" + name, frozenset({**LABEL, **labels}.items()))]


def buckets(samples, name: str) -> dict[str, float]:
    """le -> cumulative count of one histogram."""
    prefix = "pagedllm:" + name + "_bucket"
    return {
        dict(labels)["le"]: count
        for (sample_name, labels), count in samples.items()
        if sample_name == prefix and dict(labels)["model_name"] == MODEL
    }


def scheduler_stats(running=0, waiting=0, usage=0.0, queries=0, hits=0, preemptions=0) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
        prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions,
    )  # fmt: skip


def finished(reason="length", *, e2e=1.0, prompt=4, generated=3, max_tokens=3, queued=0.25, prefill=0.25,
             inference=0.75, decode=0.5, tpot=0.25) -> FinishedRequestStats:  # fmt: skip
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=e2e, num_prompt_tokens=prompt, num_generation_tokens=generated,
        max_tokens_param=max_tokens, queued_time=queued, prefill_time=prefill, inference_time=inference,
        decode_time=decode, mean_time_per_output_token=tpot,
    )  # fmt: skip


# ------------------------------------------------------------- exposition


def test_every_metric_is_exposed_with_the_model_name_label_before_any_traffic():
    samples = scrape(StatLoggerManager(MODEL, EngineConfig()))
    for name in GAUGES:
        assert any(key[0] == "pagedllm:" + name and ("model_name", MODEL) in key[1] for key in samples), name
    for name in COUNTERS:
        assert all(s.endswith("_total") for s, _ in samples if s.startswith(f"pagedllm:{name}_"))
    for name in ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "generation_tokens"]:  # fmt: skip
        assert value(samples, name + "_total") == 0.0
    for reason in ("stop", "length", "abort"):
        assert value(samples, "request_success_total", finished_reason=reason) == 0.0
    for name in HISTOGRAMS:
        assert value(samples, name + "_count") == 0.0 and value(samples, name + "_sum") == 0.0
        assert buckets(samples, name)["+Inf"] == 0.0
    # No `_created` series (vLLM disables them too).
    assert not any(name.endswith("_created") for name, _ in samples)


def test_histogram_buckets_are_vllms():
    samples = scrape(StatLoggerManager(MODEL, EngineConfig(model={"max_model_len": 1000})))
    assert [float(le) for le in buckets(samples, "time_to_first_token_seconds") if le != "+Inf"] == TTFT_BUCKETS
    assert [float(le) for le in buckets(samples, "e2e_request_latency_seconds") if le != "+Inf"] == (
        REQUEST_LATENCY_BUCKETS
    )
    assert build_1_2_5_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert [float(le) for le in buckets(samples, "request_prompt_tokens") if le != "+Inf"] == [
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000
    ]
    assert [float(le) for le in buckets(samples, "request_params_n") if le != "+Inf"] == [1, 2, 5, 10, 20]


def test_scheduler_stats_set_gauges_and_add_prefix_cache_and_preemption_deltas():
    manager = StatLoggerManager(MODEL)
    manager.record(scheduler_stats(running=2, waiting=3, usage=0.25, queries=100, hits=40, preemptions=1), None)
    manager.record(scheduler_stats(running=1, waiting=0, usage=0.5, queries=50, hits=50, preemptions=4), None)
    manager.record(scheduler_stats(running=1, waiting=0, usage=0.5, queries=0, hits=0, preemptions=4), None)
    samples = scrape(manager)
    assert value(samples, "num_requests_running") == 1.0
    assert value(samples, "num_requests_waiting") == 0.0
    assert value(samples, "kv_cache_usage_perc") == 0.5
    # Interval deltas summed; the cumulative preemption count turned into increments.
    assert value(samples, "prefix_cache_queries_total") == 150.0
    assert value(samples, "prefix_cache_hits_total") == 90.0
    assert value(samples, "num_preemptions_total") == 4.0
    # Scheduler stats alone are no iteration.
    assert value(samples, "iteration_tokens_total_count") == 0.0


def test_iteration_stats_feed_token_counters_and_latency_histograms():
    manager = StatLoggerManager(MODEL, EngineConfig(model={"max_model_len": 100}))
    step1 = IterationStats(num_prompt_tokens=7, num_generation_tokens=2, time_to_first_tokens=[0.03125, 0.375])
    step2 = IterationStats(
        num_generation_tokens=3,
        inter_token_latencies=[0.0625, 0.0625, 0.5],
        finished_requests=[
            finished("stop", e2e=1.25, prompt=4, generated=3, max_tokens=16, queued=0.25, prefill=0.125,
                     inference=1.0, decode=0.875, tpot=0.4375),
            finished("length", e2e=3.0, prompt=3, generated=1, max_tokens=None, queued=2.0, prefill=0.5,
                     inference=0.5, decode=0.0, tpot=None),
        ],
        n_params=[1, 2],
    )
    manager.record(None, step1, num_scheduled_tokens=9)
    manager.record(None, step2)  # no scheduled count: prompt + generation tokens (3)
    samples = scrape(manager)

    assert value(samples, "prompt_tokens_total") == 7.0
    assert value(samples, "generation_tokens_total") == 5.0
    assert value(samples, "request_success_total", finished_reason="stop") == 1.0
    assert value(samples, "request_success_total", finished_reason="length") == 1.0
    assert value(samples, "request_success_total", finished_reason="abort") == 0.0

    def histogram(name):
        return value(samples, name + "_count"), value(samples, name + "_sum"), buckets(samples, name)

    count, total, ttft = histogram("time_to_first_token_seconds")
    assert (count, total) == (2.0, 0.40625)
    assert (ttft["0.02"], ttft["0.04"], ttft["0.25"], ttft["0.5"], ttft["+Inf"]) == (0.0, 1.0, 1.0, 2.0, 2.0)
    count, total, itl = histogram("inter_token_latency_seconds")
    assert (count, total) == (3.0, 0.625)
    assert (itl["0.05"], itl["0.075"], itl["0.4"], itl["0.5"]) == (0.0, 2.0, 2.0, 3.0)
    # TPOT only for requests with at least 2 output tokens.
    count, total, tpot = histogram("request_time_per_output_token_seconds")
    assert (count, total, tpot["0.4"], tpot["0.5"]) == (1.0, 0.4375, 0.0, 1.0)
    count, total, e2e = histogram("e2e_request_latency_seconds")
    assert (count, total, e2e["1.0"], e2e["1.5"], e2e["2.5"], e2e["5.0"]) == (2.0, 4.25, 0.0, 1.0, 1.0, 2.0)
    assert histogram("request_queue_time_seconds")[:2] == (2.0, 2.25)
    assert histogram("request_prefill_time_seconds")[:2] == (2.0, 0.625)
    assert histogram("request_inference_time_seconds")[:2] == (2.0, 1.5)
    assert histogram("request_decode_time_seconds")[:2] == (2.0, 0.875)
    count, total, prompt = histogram("request_prompt_tokens")
    assert (count, total, prompt["2.0"], prompt["5.0"]) == (2.0, 7.0, 0.0, 2.0)
    count, total, generated = histogram("request_generation_tokens")
    assert (count, total, generated["1.0"], generated["5.0"]) == (2.0, 4.0, 1.0, 2.0)
    # max_tokens=None (up to the context) is not a parameter value.
    assert histogram("request_params_max_tokens")[:2] == (1.0, 16.0)
    count, total, n = histogram("request_params_n")
    assert (count, total, n["1.0"], n["2.0"]) == (2.0, 3.0, 1.0, 2.0)
    count, total, iteration = histogram("iteration_tokens_total")
    assert (count, total, iteration["1.0"], iteration["8.0"], iteration["16.0"]) == (2.0, 12.0, 0.0, 1.0, 2.0)


def test_cache_config_info_carries_the_cache_config_and_the_real_block_count():
    config = EngineConfig(cache={"block_size": 8, "enable_prefix_caching": False})
    manager = StatLoggerManager(MODEL, config)
    manager.log_engine_initialized(num_kv_blocks=64)
    infos = [labels for (name, labels), v in scrape(manager).items() if name == "pagedllm:cache_config_info"]
    assert len(infos) == 1  # the block count replaced the unknown one
    assert dict(infos[0]) == {
        "model_name": MODEL,
        "block_size": "8",
        "num_kv_blocks": "64",
        "enable_prefix_caching": "False",
        "prefix_caching_hash_algo": "sha256",
        "gpu_memory_utilization": "0.9",
    }
    assert scrape(manager)[("pagedllm:cache_config_info", infos[0])] == 1.0


def test_two_managers_in_one_process_do_not_share_collectors():
    first, second = StatLoggerManager(MODEL), StatLoggerManager(MODEL)
    first.record(None, IterationStats(num_generation_tokens=5))
    assert value(scrape(first), "generation_tokens_total") == 5.0
    assert value(scrape(second), "generation_tokens_total") == 0.0


# ------------------------------------------------------ OutputProcessor


def out(request_id, tokens, scheduled, finish_reason=None, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, tokens, finish_reason=finish_reason, first_scheduled_time=scheduled, **kwargs)


def step(processor, outputs, now) -> IterationStats:
    stats = IterationStats(iteration_timestamp=now)
    processor.process_outputs(outputs, now=now, iteration_stats=stats)
    return stats


def test_output_processor_fills_iteration_stats_for_a_scripted_request():
    processor = OutputProcessor(None)
    params = SamplingParams(max_tokens=3, detokenize=False)
    add(processor, "a", None, [1, 2, 3, 4], params, arrival_time=100.0)

    first = step(processor, [out("a", [7], 100.5)], now=101.0)
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (4, 1)
    assert first.time_to_first_tokens == [1.0] and first.inter_token_latencies == []
    assert first.finished_requests == [] and first.n_params == []

    second = step(processor, [out("a", [8], 100.5)], now=101.25)
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 1)
    assert second.time_to_first_tokens == [] and second.inter_token_latencies == [0.25]

    last = step(processor, [out("a", [9], 100.5, "length")], now=101.75)
    assert last.inter_token_latencies == [0.5]
    assert last.finished_requests == [
        FinishedRequestStats(
            finish_reason="length", e2e_latency=1.75, num_prompt_tokens=4, num_generation_tokens=3,
            max_tokens_param=3, queued_time=0.5, prefill_time=0.5, inference_time=1.25, decode_time=0.75,
            mean_time_per_output_token=0.375,
        )
    ]  # fmt: skip
    assert last.n_params == [1]


def test_output_processor_counts_each_sample_of_n_and_n_once_when_all_finish():
    processor = OutputProcessor(None)
    add(processor, "p", None, [1, 2, 3], SamplingParams(n=2, max_tokens=4, detokenize=False),
                          arrival_time=10.0)  # fmt: skip
    # Both samples' first tokens in one step; sample 1 got two tokens at once.
    first = step(processor, [out("0_p", [5], 10.25), out("1_p", [6, 7], 10.5)], now=11.0)
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (6, 3)
    assert first.time_to_first_tokens == [1.0, 1.0]

    second = step(processor, [out("0_p", [2], 10.25, "stop"), out("1_p", [8], 10.5)], now=11.5)
    assert second.inter_token_latencies == [0.5, 0.5] and second.n_params == []
    (stopped,) = second.finished_requests
    assert (stopped.finish_reason, stopped.e2e_latency, stopped.queued_time, stopped.prefill_time) == (
        "stop", 1.5, 0.25, 0.75
    )
    assert (stopped.num_generation_tokens, stopped.decode_time, stopped.mean_time_per_output_token) == (2, 0.5, 0.5)

    last = step(processor, [out("1_p", [9], 10.5, "length")], now=12.5)
    (done,) = last.finished_requests
    assert (done.num_prompt_tokens, done.num_generation_tokens, done.max_tokens_param) == (3, 4, 4)
    assert (done.inference_time, done.decode_time, done.mean_time_per_output_token) == (2.0, 1.5, 0.5)
    assert last.n_params == [2]


def test_output_processor_stats_skip_token_free_chunks_and_aborted_requests():
    processor = OutputProcessor(None)
    add(processor, "a", None, [1, 2], SamplingParams(detokenize=False), arrival_time=0.0)
    add(processor, "b", None, [1, 2], SamplingParams(detokenize=False), arrival_time=0.0)
    processor.abort_requests(["b"])
    stats = step(processor, [out("a", [], 0.5), out("b", [3], 0.5)], now=1.0)
    assert stats == IterationStats(iteration_timestamp=1.0)
    # An engine-side abort before any token: zero-length phases, no TPOT.
    stats = step(processor, [out("a", [], 0.5, "abort")], now=2.0)
    (aborted,) = stats.finished_requests
    assert (aborted.finish_reason, aborted.e2e_latency, aborted.queued_time, aborted.prefill_time) == (
        "abort", 2.0, 0.5, 0.0
    )
    assert (aborted.num_generation_tokens, aborted.mean_time_per_output_token) == (0, None)
    assert stats.num_prompt_tokens == 0 and stats.time_to_first_tokens == []


def test_abort_here_counts_each_unfinished_sample_once_with_its_phases():
    processor = OutputProcessor(None)
    add(processor, "p", None, [1, 2, 3], SamplingParams(n=3, max_tokens=4, detokenize=False),
                          arrival_time=10.0)  # fmt: skip
    add(processor, "q", None, [1], SamplingParams(max_tokens=4, detokenize=False), arrival_time=10.0)
    # Sample 0 finishes normally, sample 1 has a token, sample 2 none yet.
    step(processor, [out("0_p", [5], 10.25, "length"), out("1_p", [6], 10.5)], now=11.0)
    stats = IterationStats()
    # A sample's id aborts its whole request; "q" is untouched; a repeat counts nothing.
    assert processor.abort_requests(["1_p", "p", "unknown"], stats, now=12.0) == ["1_p", "2_p"]
    assert processor.abort_requests(["p"], stats, now=13.0) == []
    assert [(f.finish_reason, f.e2e_latency, f.num_generation_tokens) for f in stats.finished_requests] == [
        ("abort", 2.0, 1), ("abort", 2.0, 0),
    ]
    assert (stats.finished_requests[0].queued_time, stats.finished_requests[0].prefill_time) == (0.5, 0.5)
    assert stats.n_params == [3]  # one observation for the request, when its last sample ended
    assert processor.get_num_unfinished_requests() == 1


def test_abort_after_the_request_finished_counts_nothing():
    processor = OutputProcessor(None)
    add(processor, "a", None, [1], SamplingParams(max_tokens=4, detokenize=False), arrival_time=0.0)
    step(processor, [out("a", [4], 0.5, "stop")], now=1.0)
    stats = IterationStats()
    assert processor.abort_requests(["a"], stats) == [] and stats.finished_requests == []


def test_stop_string_finish_is_recorded_as_stop():
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_dir())
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode("ab. cd")
    add(processor, "s", None, [1, 2], SamplingParams(stop=["."], max_tokens=len(ids) + 5), arrival_time=0.0)
    stats = IterationStats()
    for index, token_id in enumerate(ids):
        stats = step(processor, [out("s", [token_id], 0.0)], now=1.0 + index)
        if stats.finished_requests:
            break
    (stopped,) = stats.finished_requests
    assert stopped.finish_reason == "stop" and stats.n_params == [1]


def test_output_processor_without_iteration_stats_is_unchanged():
    processor = OutputProcessor(None)
    add(processor, "a", None, [1], SamplingParams(max_tokens=1, detokenize=False), arrival_time=0.0)
    processed = processor.process_outputs([out("a", [4], 0.5, "length")], now=1.0)
    (output,) = processed.request_outputs
    assert output.outputs[0].token_ids == [4] and output.metrics.finished_time == 1.0


def test_processor_stats_reach_the_exposition():
    processor = OutputProcessor(None)
    manager = StatLoggerManager(MODEL)
    add(processor, "a", None, [1, 2, 3], SamplingParams(max_tokens=2, detokenize=False), arrival_time=0.0)
    manager.record(scheduler_stats(running=1), step(processor, [out("a", [4], 0.25)], now=0.5), 3)
    manager.record(scheduler_stats(), step(processor, [out("a", [5], 0.25, "length")], now=0.75), 1)
    samples = scrape(manager)
    assert value(samples, "prompt_tokens_total") == 3.0
    assert value(samples, "generation_tokens_total") == 2.0
    assert value(samples, "request_success_total", finished_reason="length") == 1.0
    assert value(samples, "time_to_first_token_seconds_sum") == 0.5
    assert value(samples, "inter_token_latency_seconds_sum") == 0.25
    assert value(samples, "e2e_request_latency_seconds_sum") == 0.75
    assert value(samples, "request_time_per_output_token_seconds_sum") == 0.25
    assert value(samples, "iteration_tokens_total_sum") == 4.0
    assert value(samples, "num_requests_running") == 0.0


# ------------------------------------------------------------ log line


def test_log_line_reports_throughput_over_the_interval_since_the_last_line(caplog):
    caplog.set_level(logging.DEBUG, logger="pagedllm.metrics")
    manager = StatLoggerManager(MODEL, EngineConfig(server={"log_stats_interval_s": 10.0}))
    manager.last_log_time = 1000.0
    manager.record(scheduler_stats(running=3, waiting=1, usage=0.5, queries=100, hits=20), None)
    manager.record(scheduler_stats(running=2, waiting=1, usage=0.25, queries=100, hits=30),
                   IterationStats(num_prompt_tokens=150, num_generation_tokens=40))  # fmt: skip
    assert manager.maybe_log(now=1009.5) is False and caplog.records == []
    assert manager.maybe_log(now=1010.0) is True
    (record,) = caplog.records
    assert (record.name, record.levelno) == ("pagedllm.metrics", logging.INFO)
    assert record.getMessage() == (
        "Avg prompt throughput: 15.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    # The next line covers only what came after the first.
    caplog.clear()
    manager.record(scheduler_stats(running=1, usage=0.125), IterationStats(num_generation_tokens=50))
    assert manager.maybe_log(now=1015.0) is False
    assert manager.maybe_log(now=1030.0) is True
    assert caplog.records[0].getMessage() == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.5 tokens/s, "
        "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 0.0%"
    )


def test_idle_log_line_drops_to_debug_and_interval_zero_never_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="pagedllm.metrics")
    manager = StatLoggerManager(MODEL, EngineConfig(server={"log_stats_interval_s": 1.0}))
    manager.last_log_time = 0.0
    assert manager.maybe_log(now=1.0) is True
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    # No stats from the core yet: the line says so instead of inventing zeros.
    assert caplog.records[0].getMessage() == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: n/a, Waiting: n/a, KV cache usage: n/a, Prefix cache hit rate: 0.0%"
    )

    silent = StatLoggerManager(MODEL, EngineConfig(server={"log_stats_interval_s": 0.0}))
    silent.record(None, IterationStats(num_generation_tokens=5))
    silent.last_log_time = 0.0
    assert silent.maybe_log(now=1e9) is False


# ------------------------------------------------------------ dashboard


def test_grafana_dashboard_queries_only_exposed_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["panels"]
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "model_name"]
    exposed = set()
    for family in text_string_to_metric_families(StatLoggerManager(MODEL).render().decode()):
        exposed |= {sample.name for sample in family.samples}
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"pagedllm:[a-z0-9_]+", expr)}
    assert used <= exposed, used - exposed
    # Every metric of the issue is on a panel, and each query is per model.
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits",
                 "prefix_cache_queries", "num_preemptions", "prompt_tokens", "generation_tokens",
                 "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"]:  # fmt: skip
        assert any(n.startswith("pagedllm:" + name) for n in used), name
    assert all('model_name="$model_name"' in expr for expr in exprs)
    assert any("histogram_quantile(0.99" in expr for expr in exprs)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_each_rank_reads_healthy_until_its_failure_ends_the_engine() -> None:
    manager = StatLoggerManager(MODEL, world_size=2)
    samples = scrape(manager)
    assert [value(samples, "executor_rank_healthy", rank=str(rank)) for rank in (0, 1)] == [1.0, 1.0]
    manager.prometheus.record_engine_dead(failed_rank=1)
    samples = scrape(manager)
    assert [value(samples, "executor_rank_healthy", rank=str(rank)) for rank in (0, 1)] == [1.0, 0.0]


def test_an_engine_dead_without_a_failed_rank_marks_every_rank_down() -> None:
    manager = StatLoggerManager(MODEL, world_size=2)
    manager.prometheus.record_engine_dead(failed_rank=None)
    samples = scrape(manager)
    assert [value(samples, "executor_rank_healthy", rank=str(rank)) for rank in (0, 1)] == [0.0, 0.0]
