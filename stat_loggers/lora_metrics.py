"""The ``prometheus`` stat logger's multi-LoRA collectors (core/stats.py
LoRAStats): vLLM's ``lora_requests_info`` gauge, and counts by adapter name.

They are created with the first LoRA figures, so an engine without
``--enable-lora`` exposes none of them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.stat_loggers.base import METRIC_PREFIX

if TYPE_CHECKING:
    from pagedllm.core.stats import LoRAStats

LORA_LOAD_TIME_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "lora_name"]
        # vLLM's: one series, labelled with the adapters now; its value is when it was set.
        self.info = Gauge(
            METRIC_PREFIX + "lora_requests_info", "Running stats on lora requests.",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry,
        )
        self.requests = Counter(
            METRIC_PREFIX + "lora_requests", "Requests that named a LoRA adapter, by adapter.", labels,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            METRIC_PREFIX + "lora_prompt_tokens", "Prompt tokens computed with a LoRA adapter, by adapter.", labels,
            registry=registry,
        )
        self.generation_tokens = Counter(
            METRIC_PREFIX + "lora_generation_tokens", "Tokens generated with a LoRA adapter, by adapter.", labels,
            registry=registry,
        )
        self.loaded = Gauge(
            METRIC_PREFIX + "lora_adapters_loaded", "LoRA adapters the engine core holds loaded.", ["model_name"],
            registry=registry,
        )
        self.load_time = Histogram(
            METRIC_PREFIX + "lora_load_time_seconds", "Time to load a LoRA adapter in the engine core.",
            ["model_name"], registry=registry, buckets=LORA_LOAD_TIME_BUCKETS,
        )

    def record(self, stats: LoRAStats) -> None:
        name = self.model_name
        self.info.clear()
        self.info.labels(
            name, str(stats.max_lora), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)
        ).set(time.time())
        for counter, counts in (
            (self.requests, stats.requests),
            (self.prompt_tokens, stats.prompt_tokens),
            (self.generation_tokens, stats.generation_tokens),
        ):
            for lora_name, count in counts.items():
                counter.labels(name, lora_name).inc(count)
        self.loaded.labels(name).set(stats.num_loaded_adapters)
        for seconds in stats.load_times_s:
            self.load_time.labels(name).observe(seconds)
