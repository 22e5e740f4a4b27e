"""Prometheus metrics and the periodic stats log line (vLLM's v1/metrics/loggers.py).

Every collector lives in this module, registered in a private
CollectorRegistry per StatLoggerManager, so several engines in one process
(tests, benchmarks) never collide. Names are vLLM's under the `pagedllm:`
prefix, each with a `model_name` label; counters are exposed with `_total`.

Driving it (what AsyncLLM does after each batch of engine-core outputs):

    iteration_stats = IterationStats()
    processed = output_processor.process_outputs(outputs, now, iteration_stats=iteration_stats)
    stat_logger.record(scheduler_stats, iteration_stats, num_scheduled_tokens)
    stat_logger.maybe_log()

and `/metrics` serves `stat_logger.render()`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.stats import SpecDecodingStats

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.engine.stats import IterationStats

logger = logging.getLogger("pagedllm.metrics")

# vLLM does the same: `<counter>_created` samples are noise for this use.
prometheus_client.disable_created_metrics()

PREFIX = "pagedllm:"
LABELS = ["model_name"]
FINISH_REASONS = ("stop", "length", "abort")
# Used for the token-count histograms when no config gives max_model_len.
DEFAULT_MAX_MODEL_LEN = 8192

# vLLM's buckets.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
TOKEN_LATENCY_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_PARAM_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


class PrometheusStatLogger:
    """The collectors, bound to one model_name in one registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = registry
        self._add_scheduler_metrics()
        self._add_token_metrics(max_model_len)
        self._add_latency_metrics()
        self._add_spec_decode_metrics()
        self._add_kv_transfer_metrics()
        # Info: a gauge fixed at 1 whose labels carry the cache config.
        self._cache_config_info: Gauge | None = None
        self.world_size = 0
        self.gauge_rank_healthy = Gauge(
            PREFIX + "executor_rank_healthy",
            "1 while an executor rank runs, 0 once it (or the engine) has failed.",
            [*LABELS, "rank"],
            registry=self.registry,
        )

        # Make every unlabelled-by-reason series exist before the first record.
        for metric in (
            self.gauge_running, self.gauge_waiting, self.gauge_kv_cache_usage,
            self.counter_prefix_cache_queries, self.counter_prefix_cache_hits, self.counter_preemptions,
            self.counter_prompt_tokens, self.counter_generation_tokens,
            self.counter_spec_decode_num_drafts, self.counter_spec_decode_num_draft_tokens,
            self.counter_spec_decode_num_accepted_tokens,
            self.counter_external_prefix_cache_queries, self.counter_external_prefix_cache_hits,
            self.counter_kv_connector_load_failures,
            self.histogram_prompt_tokens, self.histogram_generation_tokens, self.histogram_iteration_tokens,
            self.histogram_max_tokens, self.histogram_n, self.histogram_ttft, self.histogram_itl,
            self.histogram_tpot, self.histogram_e2e, self.histogram_queue_time, self.histogram_inference_time,
            self.histogram_prefill_time, self.histogram_decode_time,
        ):  # fmt: skip
            metric.labels(model_name)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, LABELS, registry=self.registry)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, LABELS, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float] | list[int]) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, registry=self.registry, buckets=buckets)

    def _add_scheduler_metrics(self) -> None:
        """Scheduler state."""
        self.gauge_running = self._gauge("num_requests_running", "Number of requests in model execution batches.")
        self.gauge_waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.gauge_kv_cache_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.counter_prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_preemptions = self._counter("num_preemptions", "Cumulative number of preemption from the engine.")

    def _add_token_metrics(self, max_model_len: int) -> None:
        """Token counters, and histograms of counts (prompt, output and step sizes, request parameters)."""
        self.counter_prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.counter_generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        request_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        # NOTE: every reason exists from the start, so a scrape shows zeros
        # rather than a missing series (rate() needs the series to exist).
        self.counter_request_success = {
            reason: request_success.labels(self.model_name, reason) for reason in FINISH_REASONS
        }
        self._request_success = request_success
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.histogram_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.histogram_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.histogram_iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.histogram_max_tokens = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.histogram_n = self._histogram("request_params_n", "Histogram of the n request parameter.", N_PARAM_BUCKETS)

    def _add_latency_metrics(self) -> None:
        """Histograms of timing intervals."""
        self.histogram_ttft = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.histogram_itl = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.histogram_tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.histogram_e2e = self._histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.histogram_queue_time = self._histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_inference_time = self._histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_decode_time = self._histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def _add_spec_decode_metrics(self) -> None:
        """Speculative decoding (zero without it)."""
        self.counter_spec_decode_num_drafts = self._counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.counter_spec_decode_num_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.counter_spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._spec_decode_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
            registry=self.registry,
        )
        self.counter_spec_decode_per_pos: dict[int, Any] = {}

    def _add_kv_transfer_metrics(self) -> None:
        """KV transfer (zero without a connector): vLLM's names, plus tiers."""
        self.counter_external_prefix_cache_queries = self._counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of tokens.",
        )
        self.counter_external_prefix_cache_hits = self._counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of tokens.",
        )
        self.counter_kv_connector_load_failures = self._counter(
            "kv_connector_load_failures", "Stored KV blocks that could not be loaded (missing, corrupted)."
        )
        self._kv_tier_blocks = Counter(
            PREFIX + "kv_connector_tier_blocks", "KV connector tier lookups, in blocks.",
            [*LABELS, "tier", "result"], registry=self.registry,
        )
        self._kv_tier_bytes = Counter(
            PREFIX + "kv_connector_tier_bytes", "Bytes moved by the KV connector, per tier and direction.",
            [*LABELS, "tier", "direction"], registry=self.registry,
        )

    def set_cache_config_info(self, info: dict[str, str]) -> None:
        if self._cache_config_info is None:
            self._cache_config_info = Gauge(
                PREFIX + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["model_name", *info],
                registry=self.registry,
            )
        else:
            self._cache_config_info.clear()  # one series: the latest config
        self._cache_config_info.labels(model_name=self.model_name, **info).set(1)

    def add_router_metrics(self, num_replicas: int) -> None:
        """Data-parallel routing (`-dp N`): per replica, the requests routed
        there, those routed for a cached prefix, the hit tokens the router
        predicted and those the replica reported, and whether it lives."""
        labels = [*LABELS, "replica"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.counter_routed_requests = counter("router_requests", "Requests routed to each data-parallel replica.")
        self.counter_routed_by_prefix = counter(
            "router_prefix_routed_requests", "Requests routed to a replica for the prompt prefix it caches."
        )
        self.counter_predicted_hit_tokens = counter(
            "router_predicted_hit_tokens", "Prompt tokens the router expected the replica's prefix cache to hold."
        )
        self.counter_actual_hit_tokens = counter(
            "router_actual_hit_tokens", "Prompt tokens the replica's prefix cache held (of routed requests)."
        )
        self.gauge_replica_healthy = Gauge(
            PREFIX + "replica_healthy", "1 while a data-parallel replica runs, 0 once it has died.",
            labels, registry=self.registry,
        )
        for replica in map(str, range(num_replicas)):
            for metric in (self.counter_routed_requests, self.counter_routed_by_prefix,
                           self.counter_predicted_hit_tokens, self.counter_actual_hit_tokens):
                metric.labels(self.model_name, replica)
            self.gauge_replica_healthy.labels(self.model_name, replica).set(1)

    # RoutingObserver (engine/dp_client.py)
    def record_route(self, replica: int, reason: str) -> None:
        self.counter_routed_requests.labels(self.model_name, str(replica)).inc()
        if reason == "prefix":
            self.counter_routed_by_prefix.labels(self.model_name, str(replica)).inc()

    def record_hit_tokens(self, replica: int, predicted: int, actual: int) -> None:
        self.counter_predicted_hit_tokens.labels(self.model_name, str(replica)).inc(predicted)
        self.counter_actual_hit_tokens.labels(self.model_name, str(replica)).inc(actual)

    def record_replica_dead(self, replica: int) -> None:
        self.gauge_replica_healthy.labels(self.model_name, str(replica)).set(0)

    def set_ranks_healthy(self, world_size: int) -> None:
        self.world_size = world_size
        for rank in range(world_size):
            self.gauge_rank_healthy.labels(self.model_name, str(rank)).set(1)

    def record_engine_dead(self, failed_rank: int | None) -> None:
        """The failed rank reads 0; when no rank is to blame (the core itself
        died), every rank does: none runs a step any more."""
        for rank in range(self.world_size):
            if failed_rank is None or rank == failed_rank:
                self.gauge_rank_healthy.labels(self.model_name, str(rank)).set(0)

    def record_scheduler_stats(self, scheduler_stats: SchedulerStats, num_new_preemptions: int) -> None:
        name = self.model_name
        self.gauge_running.labels(name).set(scheduler_stats.num_running_reqs)
        self.gauge_waiting.labels(name).set(scheduler_stats.num_waiting_reqs)
        self.gauge_kv_cache_usage.labels(name).set(scheduler_stats.kv_cache_usage)
        self.counter_prefix_cache_queries.labels(name).inc(scheduler_stats.prefix_cache_queries)
        self.counter_prefix_cache_hits.labels(name).inc(scheduler_stats.prefix_cache_hits)
        self.counter_preemptions.labels(name).inc(num_new_preemptions)
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None:
            self.counter_spec_decode_num_drafts.labels(name).inc(spec.num_drafts)
            self.counter_spec_decode_num_draft_tokens.labels(name).inc(spec.num_draft_tokens)
            self.counter_spec_decode_num_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.num_accepted_tokens_per_pos):
                counter = self.counter_spec_decode_per_pos.get(position)
                if counter is None:
                    counter = self.counter_spec_decode_per_pos[position] = self._spec_decode_per_pos.labels(
                        name, str(position)
                    )
                counter.inc(count)
        kv = scheduler_stats.kv_connector_stats
        if kv is not None:
            self.counter_external_prefix_cache_queries.labels(name).inc(kv.external_queries)
            self.counter_external_prefix_cache_hits.labels(name).inc(kv.external_hits)
            self.counter_kv_connector_load_failures.labels(name).inc(kv.load_failures)
            for result, table in (("hit", kv.tier_hits), ("miss", kv.tier_misses)):
                for tier, count in table.items():
                    self._kv_tier_blocks.labels(name, tier, result).inc(count)
            for direction, table in (("saved", kv.tier_bytes_saved), ("loaded", kv.tier_bytes_loaded)):
                for tier, count in table.items():
                    self._kv_tier_bytes.labels(name, tier, direction).inc(count)

    def record_iteration_stats(self, iteration_stats: IterationStats) -> None:
        name = self.model_name
        self.counter_prompt_tokens.labels(name).inc(iteration_stats.num_prompt_tokens)
        self.counter_generation_tokens.labels(name).inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.histogram_ttft.labels(name).observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.histogram_itl.labels(name).observe(itl)
        for n in iteration_stats.n_params:
            self.histogram_n.labels(name).observe(n)
        for finished in iteration_stats.finished_requests:
            reason = finished.finish_reason
            if reason not in self.counter_request_success:
                self.counter_request_success[reason] = self._request_success.labels(name, reason)
            self.counter_request_success[reason].inc()
            self.histogram_e2e.labels(name).observe(finished.e2e_latency)
            self.histogram_queue_time.labels(name).observe(finished.queued_time)
            self.histogram_prefill_time.labels(name).observe(finished.prefill_time)
            self.histogram_inference_time.labels(name).observe(finished.inference_time)
            self.histogram_decode_time.labels(name).observe(finished.decode_time)
            self.histogram_prompt_tokens.labels(name).observe(finished.num_prompt_tokens)
            self.histogram_generation_tokens.labels(name).observe(finished.num_generation_tokens)
            if finished.mean_time_per_output_token is not None:
                self.histogram_tpot.labels(name).observe(finished.mean_time_per_output_token)
            if finished.max_tokens_param:
                self.histogram_max_tokens.labels(name).observe(finished.max_tokens_param)

    def observe_iteration_tokens(self, num_tokens: int) -> None:
        self.histogram_iteration_tokens.labels(self.model_name).observe(num_tokens)


class StatLoggerManager:
    """Prometheus collectors plus vLLM's periodic "Avg prompt throughput" line.

    `record()` after every engine step; `maybe_log()` as often as convenient
    (it logs once per `config.server.log_stats_interval_s`, never when 0);
    `render()` for the `/metrics` body (served with `CONTENT_TYPE`).
    """

    CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

    def __init__(
        self,
        model_name: str,
        config: EngineConfig | None = None,
        registry: CollectorRegistry | None = None,
        *,
        num_kv_blocks: int | None = None,
        max_model_len: int | None = None,
        world_size: int = 1,
    ) -> None:
        self.model_name = model_name
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # The token-count histograms' buckets reach max_model_len (vLLM).
        if max_model_len is None and config is not None:
            max_model_len = config.model.max_model_len
        if max_model_len is None:
            max_model_len = DEFAULT_MAX_MODEL_LEN
        self.prometheus = PrometheusStatLogger(model_name, self.registry, max_model_len)
        self.log_interval_s = config.server.log_stats_interval_s if config is not None else 0.0
        self.log_engine_initialized(num_kv_blocks)
        self.prometheus.set_ranks_healthy(world_size)

        # The engine's preemption count is cumulative; the counter gets deltas.
        self._last_num_preemptions = 0
        self.last_scheduler_stats: SchedulerStats | None = None
        # Totals since the previous log line.
        self.last_log_time = time.monotonic()
        self.interval_prompt_tokens = 0
        self.interval_generation_tokens = 0
        self.interval_prefix_cache_queries = 0
        self.interval_prefix_cache_hits = 0
        self._last_throughputs = (0.0, 0.0)
        self.interval_spec_decoding_stats: SpecDecodingStats | None = None
        self.interval_external_queries = self.interval_external_hits = 0

    def log_engine_initialized(self, num_kv_blocks: int | None = None) -> None:
        """(Re)set `cache_config_info`; call again once the engine reports its
        real number of KV blocks (the config's is None when sized from memory)."""
        cache = self.config.cache if self.config is not None else None
        if num_kv_blocks is None and cache is not None:
            num_kv_blocks = cache.num_kv_blocks
        info = {
            "block_size": "" if cache is None else str(cache.block_size),
            "num_kv_blocks": "" if num_kv_blocks is None else str(num_kv_blocks),
            "enable_prefix_caching": "" if cache is None else str(cache.enable_prefix_caching),
            "prefix_caching_hash_algo": "" if cache is None else cache.prefix_caching_hash_algo,
            "gpu_memory_utilization": "" if cache is None else str(cache.gpu_memory_utilization),
        }
        self.prometheus.set_cache_config_info(info)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        num_scheduled_tokens: int | None = None,
    ) -> None:
        """Account one engine step. `num_scheduled_tokens` (the tokens the step
        ran) feeds `iteration_tokens_total`; without it the step's prompt +
        generation tokens do, as in vLLM."""
        if scheduler_stats is not None:
            cumulative = scheduler_stats.num_preemptions
            # A smaller count means a new engine core: it starts from zero.
            base = self._last_num_preemptions if cumulative >= self._last_num_preemptions else 0
            self._last_num_preemptions = cumulative
            self.prometheus.record_scheduler_stats(scheduler_stats, cumulative - base)
            self.interval_prefix_cache_queries += scheduler_stats.prefix_cache_queries
            self.interval_prefix_cache_hits += scheduler_stats.prefix_cache_hits
            if scheduler_stats.kv_connector_stats is not None:
                self.interval_external_queries += scheduler_stats.kv_connector_stats.external_queries
                self.interval_external_hits += scheduler_stats.kv_connector_stats.external_hits
            self.last_scheduler_stats = scheduler_stats
            spec = scheduler_stats.spec_decoding_stats
            if spec is not None:
                if self.interval_spec_decoding_stats is None:
                    self.interval_spec_decoding_stats = SpecDecodingStats.new(spec.num_spec_tokens)
                self.interval_spec_decoding_stats.add(spec)
        if iteration_stats is not None:
            self.prometheus.record_iteration_stats(iteration_stats)
            self.interval_prompt_tokens += iteration_stats.num_prompt_tokens
            self.interval_generation_tokens += iteration_stats.num_generation_tokens
        if num_scheduled_tokens is not None:
            if num_scheduled_tokens > 0:  # an idle stats message is no iteration
                self.prometheus.observe_iteration_tokens(num_scheduled_tokens)
        elif iteration_stats is not None:
            step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
            if step_tokens > 0:
                self.prometheus.observe_iteration_tokens(step_tokens)

    def maybe_log(self, now: float | None = None) -> bool:
        """Log the stats line when the interval has elapsed; True if it did.
        `now` is time.monotonic()-based."""
        if self.log_interval_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        if now - self.last_log_time < self.log_interval_s:
            return False
        self.log(now)
        return True

    def log(self, now: float | None = None) -> str:
        """Log (and return) the stats line over the interval since the last
        one, then start a new interval."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_log_time
        prompt_throughput = self.interval_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_throughput = self.interval_generation_tokens / elapsed if elapsed > 0 else 0.0
        queries, hits = self.interval_prefix_cache_queries, self.interval_prefix_cache_hits
        hit_rate = hits / queries if queries else 0.0
        line = (
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"{_describe_queues(self.last_scheduler_stats)}, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        if self.interval_external_queries:
            external_rate = self.interval_external_hits / self.interval_external_queries
            line += f", External prefix cache hit rate: {external_rate * 100:.1f}%"
        self.interval_external_queries = self.interval_external_hits = 0
        spec = self.interval_spec_decoding_stats
        if spec is not None and spec.num_drafts:
            line += (
                f", Spec decode acceptance rate: {spec.acceptance_rate * 100:.1f}%, "
                f"Mean acceptance length: {spec.mean_acceptance_length:.2f}, "
                "Per-position acceptance rate: "
                + ", ".join(f"{count / spec.num_drafts:.3f}" for count in spec.num_accepted_tokens_per_pos)
            )
        if spec is not None:
            self.interval_spec_decoding_stats = SpecDecodingStats.new(spec.num_spec_tokens)
        # An idle server would repeat the same zero line forever (vLLM: debug).
        idle = not any((prompt_throughput, generation_throughput, *self._last_throughputs))
        logger.log(logging.DEBUG if idle else logging.INFO, "%s", line)
        self._last_throughputs = (prompt_throughput, generation_throughput)
        self.last_log_time = now
        self.interval_prompt_tokens = self.interval_generation_tokens = 0
        self.interval_prefix_cache_queries = self.interval_prefix_cache_hits = 0
        return line

    def render(self) -> bytes:
        """The Prometheus text exposition of this engine's metrics."""
        return generate_latest(self.registry)


def _describe_queues(stats: SchedulerStats | None) -> str:
    # No stats from the core yet: say so rather than print zeros it never reported.
    if stats is None:
        return "Running: n/a, Waiting: n/a, KV cache usage: n/a"
    return (
        f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
        f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%"
    )
