"""Per-request records and the summary a serving benchmark reports.

Definitions (REFERENCE.md, as vLLM's benchmark computes them client-side):
- TTFT: request send -> first streamed chunk carrying a choice.
- ITL: gaps between successive chunks carrying a choice (one list per request,
  pooled over requests for the summary).
- TPOT: (e2e - ttft) / (output tokens - 1), only for requests with > 1 token.
- E2E: request send -> end of the stream.
- Goodput: completions that met every SLO / duration. Every offered request is
  in the count, so a failed or unfinished request is simply a miss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.core.errors import ConfigError

SLO_KEYS = ("ttft", "tpot", "e2e")
# vLLM spells the end-to-end SLO "e2el"; accept it so its command lines carry over.
_SLO_ALIASES = {"e2el": "e2e"}


@dataclass
class RequestRecord:
    """What one benchmark request observed. Times are seconds."""

    index: int
    prompt_len: int
    output_len_requested: int
    success: bool = False
    error: str = ""
    # perf_counter() offsets from the benchmark start
    start_time: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    # from usage.completion_tokens when the server sent it, else the chunk count
    output_tokens: int = 0
    num_chunks: int = 0
    output_tokens_from_usage: bool = False
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["tpot"] = self.tpot
        return payload


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 0.2, "tpot": 0.05}`` (seconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        key, sep, value = spec.partition(":")
        key = _SLO_ALIASES.get(key.strip().lower(), key.strip().lower())
        allowed = "KEY:MILLISECONDS with KEY one of ttft, tpot, e2e and a positive number"
        if not sep or key not in SLO_KEYS:
            raise ConfigError("--goodput", spec, allowed)
        try:
            milliseconds = float(value)
        except ValueError:
            raise ConfigError("--goodput", spec, allowed) from None
        if not math.isfinite(milliseconds) or milliseconds <= 0:
            raise ConfigError("--goodput", spec, allowed)
        slos[key] = milliseconds / 1000.0
    return slos


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        return cls(
            mean=1000.0 * sum(seconds) / len(seconds),
            p50=1000.0 * percentile(seconds, 50),
            p99=1000.0 * percentile(seconds, 99),
        )


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    # A one-token completion has no decode phase: its TPOT SLO holds (as in vLLM).
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2e": record.e2e}
    return all(observed[key] <= limit for key, limit in slos.items())


@dataclass(frozen=True)
class BenchmarkMetrics:
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    # None when no SLO was given
    good_completions: int | None
    goodput: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(
    records: list[RequestRecord], duration_s: float, slos: dict[str, float] | None = None
) -> BenchmarkMetrics:
    """Summarise `records` (one per offered request) over `duration_s` seconds."""
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    # NOTE: a zero duration (nothing was sent) must not divide; rates are then 0.
    rate = (lambda count: count / duration_s) if duration_s > 0 else (lambda count: 0.0)
    good: int | None = None
    if slos:
        good = sum(1 for r in records if meets_slos(r, slos))
    return BenchmarkMetrics(
        num_prompts=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=rate(len(done)),
        output_throughput=rate(total_output),
        total_token_throughput=rate(total_input + total_output),
        ttft_ms=LatencyStats.of([r.ttft for r in done]),
        tpot_ms=LatencyStats.of([t for r in done if (t := r.tpot) is not None]),
        itl_ms=LatencyStats.of([gap for r in done for gap in r.itl]),
        e2e_ms=LatencyStats.of([r.e2e for r in done]),
        good_completions=good,
        goodput=None if good is None else rate(good),
    )
