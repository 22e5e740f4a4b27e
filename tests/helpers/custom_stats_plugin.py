"""A test plugin: a KV connector that attaches custom figures to the engine
core's stats, and a stat logger that records everything it receives.

Registered in-process with ``pm.register(custom_stats_plugin, name=...)``;
the server test copies this file next to a dist-info whose entry point names
it, so that ``pagedllm serve`` loads it in both of its processes.

``counting_offload`` is the CPU tier (``cpu_offload``) plus, on its scheduler
side, a count of the KV blocks each finished request held ("saved"):

- ``blocks_saved`` (counter): blocks of every finished request so far;
- ``last_finished_blocks`` (gauge): the blocks the latest finished request held;
- ``blocks_per_finished_request`` (histogram): one observation per finished request.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.core.custom_stats import MetricSpec, MetricType
from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
from pagedllm.plugins import hookimpl
from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext

PAGEDLLM_API_VERSION = ">=1.7,<2"

CONNECTOR_NAME = "counting_offload"
LOGGER_NAME = "recording"


class CountingOffloadConnector(CpuOffloadConnector):
    custom_metrics = (
        MetricSpec("blocks_saved", MetricType.COUNTER, "KV blocks held by finished requests."),
        MetricSpec("last_finished_blocks", MetricType.GAUGE, "KV blocks the latest finished request held."),
        MetricSpec(
            "blocks_per_finished_request", MetricType.HISTOGRAM, "KV blocks per finished request.",
            buckets=[1.0, 2.0, 4.0, 8.0],
        ),
    )

    def __init__(self, config: Any, context: Any) -> None:
        super().__init__(config, context)
        self.blocks_saved = 0
        self.last_finished_blocks = 0
        self.new_observations: list[float] = []

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        self.blocks_saved += len(block_ids)
        self.last_finished_blocks = len(block_ids)
        self.new_observations.append(float(len(block_ids)))
        return super().request_finished(request, block_ids)

    def get_custom_stats(self) -> dict[str, float | list[float]]:
        observations, self.new_observations = self.new_observations, []
        return {
            "blocks_saved": self.blocks_saved,
            "last_finished_blocks": self.last_finished_blocks,
            "blocks_per_finished_request": observations,
        }


class RecordingStatLogger(StatLoggerBase):
    """Keeps every call it receives; ``instances`` holds each one built."""

    instances: ClassVar[list[RecordingStatLogger]] = []

    def __init__(self, context: StatLoggerContext) -> None:
        super().__init__(context)
        self.records: list[tuple[Any, Any, int | None]] = []
        self.calls: list[str] = []
        RecordingStatLogger.instances.append(self)

    def record(self, scheduler_stats: Any, iteration_stats: Any, num_scheduled_tokens: int | None = None) -> None:
        self.records.append((scheduler_stats, iteration_stats, num_scheduled_tokens))

    def log(self, now: float | None = None) -> None:
        self.calls.append("log")

    def log_engine_initialized(self) -> None:
        self.calls.append("log_engine_initialized")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@hookimpl
def register_kv_connectors(register: Any) -> None:
    register(CONNECTOR_NAME, CountingOffloadConnector, roles=["both"])


@hookimpl
def register_stat_loggers(register: Any) -> None:
    register(LOGGER_NAME, RecordingStatLogger)
