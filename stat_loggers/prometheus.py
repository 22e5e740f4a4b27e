"""The built-in stat logger ``prometheus``: the collectors behind ``/metrics``
(vLLM's v1/metrics/loggers.py PrometheusStatLogger).

Every collector lives in the registry its context gives (one per front end),
so several engines in one process (tests, benchmarks) never collide. Names
are vLLM's under the ``pagedllm:`` prefix, each with a ``model_name`` label;
counters are exposed with ``_total``. The custom figures plugins declare
(core/custom_stats.py) get one collector each, named ``pagedllm:<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.core.custom_stats import MetricSpec, MetricType
from pagedllm.stat_loggers.base import METRIC_PREFIX, StatLoggerBase, StatLoggerContext
from pagedllm.stat_loggers.lora_metrics import LoRAMetrics
from pagedllm.stat_loggers.step_cost_metrics import StepCostMetrics

if TYPE_CHECKING:
    from pagedllm.core.stats import IterationStats, SchedulerStats

# vLLM does the same: `<counter>_created` samples are noise for this use.
prometheus_client.disable_created_metrics()

PREFIX = METRIC_PREFIX
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


class PrometheusStatLogger(StatLoggerBase):
    """The collectors, bound to one model_name in the context's registry."""

    def __init__(self, context: StatLoggerContext) -> None:
        super().__init__(context)
        model_name = self.model_name = context.model_name
        self.registry: CollectorRegistry = context.registry
        max_model_len = context.max_model_len
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
        self.set_ranks_healthy(context.world_size)
        self.custom_collectors = self._add_custom_metrics(context.custom_metrics)
        # The engine's preemption count is cumulative; the counter gets deltas.
        self._last_num_preemptions = 0
        # Multi-LoRA collectors, made with the first LoRA figures.
        self.lora_metrics: LoRAMetrics | None = None
        # The step cost model's collectors, made with its first figures.
        self.step_cost_metrics: StepCostMetrics | None = None

    # ---- StatLoggerBase -------------------------------------------------

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        num_scheduled_tokens: int | None = None,
    ) -> None:
        """`num_scheduled_tokens` (the tokens the step ran) feeds
        `iteration_tokens_total`; without it the step's prompt + generation
        tokens do, as in vLLM."""
        if scheduler_stats is not None:
            cumulative = scheduler_stats.num_preemptions
            # A smaller count means a new engine core: it starts from zero.
            base = self._last_num_preemptions if cumulative >= self._last_num_preemptions else 0
            self._last_num_preemptions = cumulative
            self.record_scheduler_stats(scheduler_stats, cumulative - base)
            if scheduler_stats.custom_stats:
                self.record_custom_stats(scheduler_stats.custom_stats)
            if scheduler_stats.lora_stats is not None:
                if self.lora_metrics is None:
                    self.lora_metrics = LoRAMetrics(self.registry, self.model_name)
                self.lora_metrics.record(scheduler_stats.lora_stats)
            if scheduler_stats.step_cost_stats is not None:
                if self.step_cost_metrics is None:
                    self.step_cost_metrics = StepCostMetrics(self.registry, self.model_name)
                self.step_cost_metrics.record(scheduler_stats.step_cost_stats)
        if iteration_stats is not None:
            self.record_iteration_stats(iteration_stats)
        if num_scheduled_tokens is not None:
            if num_scheduled_tokens > 0:  # an idle stats message is no iteration
                self.observe_iteration_tokens(num_scheduled_tokens)
        elif iteration_stats is not None:
            step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
            if step_tokens > 0:
                self.observe_iteration_tokens(step_tokens)

    def log_engine_initialized(self) -> None:
        """(Re)set `cache_config_info` from the config and the engine's real
        number of KV blocks (the config's is None when sized from memory)."""
        config = self.context.config
        cache = config.cache if config is not None else None
        num_kv_blocks = self.context.num_kv_blocks
        if num_kv_blocks is None and cache is not None:
            num_kv_blocks = cache.num_kv_blocks
        self.set_cache_config_info({
            "block_size": "" if cache is None else str(cache.block_size),
            "num_kv_blocks": "" if num_kv_blocks is None else str(num_kv_blocks),
            "enable_prefix_caching": "" if cache is None else str(cache.enable_prefix_caching),
            "prefix_caching_hash_algo": "" if cache is None else cache.prefix_caching_hash_algo,
            "gpu_memory_utilization": "" if cache is None else str(cache.gpu_memory_utilization),
        })  # fmt: skip

    # ---- custom figures -------------------------------------------------

    def _add_custom_metrics(self, specs: tuple[MetricSpec, ...]) -> dict[str, tuple[MetricSpec, Any]]:
        """One collector per declared figure, its series there from the start."""
        collectors: dict[str, tuple[MetricSpec, Any]] = {}
        for spec in specs:
            name = PREFIX + spec.name
            collector: Counter | Gauge | Histogram
            if spec.type == MetricType.COUNTER:
                collector = Counter(name, spec.help, LABELS, registry=self.registry)
            elif spec.type == MetricType.GAUGE:
                collector = Gauge(name, spec.help, LABELS, registry=self.registry)
            else:
                buckets = spec.buckets if spec.buckets is not None else Histogram.DEFAULT_BUCKETS
                collector = Histogram(name, spec.help, LABELS, registry=self.registry, buckets=buckets)
            collectors[spec.name] = (spec, collector.labels(self.model_name))
        return collectors

    def record_custom_stats(self, figures: dict[str, float | list[float]]) -> None:
        for name, value in figures.items():
            entry = self.custom_collectors.get(name)
            if entry is None:  # not declared in READY: the core already left such out
                continue
            spec, series = entry
            if spec.type == MetricType.COUNTER and isinstance(value, float):
                series.inc(value)
            elif spec.type == MetricType.GAUGE and isinstance(value, float):
                series.set(value)
            elif spec.type == MetricType.HISTOGRAM and isinstance(value, list):
                for observation in value:
                    series.observe(observation)

    # ---- the built-in collectors ---------------------------------------

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

