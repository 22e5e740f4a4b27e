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

``counting_ngram`` is the ``ngram`` drafter counting the draft tokens it
proposes (``draft_tokens_proposed``, a counter): a figure made on the rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

from pagedllm.core.custom_stats import MetricSpec, MetricType
from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
from pagedllm.plugins import hookimpl
from pagedllm.spec_decode.ngram import NgramDrafter
from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext

PAGEDLLM_API_VERSION = ">=1.7,<2"

# The module name it is installed under by `write_plugin_site`.
SITE_MODULE = "pagedllm_custom_stats_test_plugin"
CONNECTOR_NAME = "counting_offload"
DRAFTER_NAME = "counting_ngram"
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


class CountingNgramDrafter(NgramDrafter):
    """ngram, counting the draft tokens it proposes (a drafter's figure)."""

    custom_metrics = (MetricSpec("draft_tokens_proposed", MetricType.COUNTER, "Draft tokens proposed."),)

    def __init__(self, config: Any, context: Any) -> None:
        super().__init__(config, context)
        self.proposed = 0

    def propose(self, inputs: Any) -> Any:
        output = super().propose(inputs)
        self.proposed += sum(len(drafts) for drafts in output.draft_token_ids)
        return output

    def get_custom_stats(self) -> dict[str, float]:
        return {"draft_tokens_proposed": self.proposed}


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
def register_drafters(register: Any) -> None:
    register(DRAFTER_NAME, CountingNgramDrafter, needs_model=False)


@hookimpl
def register_stat_loggers(register: Any) -> None:
    register(LOGGER_NAME, RecordingStatLogger)


def write_plugin_site(site: Path) -> Path:
    """Install this file into `site` as a distribution whose entry point
    names it; processes with `site` on PYTHONPATH load it as a plugin."""
    shutil.copy(__file__, site / f"{SITE_MODULE}.py")
    info = site / f"{SITE_MODULE}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedllm-custom-stats-test-plugin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[pagedllm.plugins]\ncustom_stats_test = {SITE_MODULE}\n")
    return site
