"""The engine core's statistics: what the scheduler reports after a step
(one type from the core to every consumer: the wire, the stat loggers, the
Prometheus exporter). msgspec structs, so the same objects go on the wire."""

from __future__ import annotations

import msgspec

# NOTE: run-time imports: msgspec resolves the field types on first use.
from pagedllm.core.custom_stats import FigureValue
from pagedllm.kv_connectors.base import KVConnectorStats


class SpecDecodingStats(msgspec.Struct, array_like=True):
    num_spec_tokens: int  # k: the length of num_accepted_tokens_per_pos
    num_drafts: int = 0  # verification steps of requests that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(min(num_accepted_tokens, self.num_spec_tokens)):
            self.num_accepted_tokens_per_pos[position] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(other.num_accepted_tokens_per_pos) > len(self.num_accepted_tokens_per_pos):
            grow = len(other.num_accepted_tokens_per_pos) - len(self.num_accepted_tokens_per_pos)
            self.num_accepted_tokens_per_pos.extend([0] * grow)
            self.num_spec_tokens = len(self.num_accepted_tokens_per_pos)
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [count / self.num_drafts if self.num_drafts else 0.0 for count in self.num_accepted_tokens_per_pos]

    def describe(self) -> str:
        per_position = ", ".join(f"{rate:.3f}" for rate in self.per_position_acceptance_rate)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
            f"Draft acceptance rate: {self.acceptance_rate * 100:.1f}%, "
            f"Per-position acceptance rate: {per_position}"
        )


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The scheduler's figures after a step, as the core sends them with the
    step's outputs (and with its idle heartbeat); the stat loggers and
    Prometheus read exactly this. Queue lengths and KV usage are the state
    now; prefix-cache counts, drafts and connector counts are deltas since
    the previous stats."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # cumulative
    # Verified drafts since the last stats (interval delta); None without speculation.
    spec_decoding_stats: SpecDecodingStats | None = None
    # The KV connector's counters since the last stats; None without one.
    kv_connector_stats: KVConnectorStats | None = None
    # Custom figures plugins attached (core/custom_stats.py): counters' increase
    # since the last stats, gauges' value, histograms' new observations; None
    # when no component reported any.
    custom_stats: dict[str, FigureValue] | None = None
