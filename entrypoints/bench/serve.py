"""``pagedllm bench serve``: a load generator for any OpenAI-compatible server.

Sends streaming ``/v1/completions`` requests with random token-id prompts
(``ignore_eos`` so every request generates exactly ``--output-len`` tokens on
vLLM and pagedllm alike), at Poisson arrival times from a seeded RNG or all at
once, optionally capped by ``--max-concurrency``; then prints vLLM's serving
report (throughput, TTFT, TPOT, ITL, E2E, goodput) and can write it as JSON
with every request's record.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError, PagedLLMError
from pagedllm.entrypoints.bench.datasets import BenchRequest, sample_random_requests, token_id_pool
from pagedllm.entrypoints.bench.metrics import (
    BenchmarkMetrics,
    LatencyStats,
    RequestRecord,
    compute_metrics,
    parse_goodput,
)

if TYPE_CHECKING:
    import httpx


class BenchmarkError(PagedLLMError):
    """The benchmark could not start (server unreachable, no model to name)."""


@dataclass(frozen=True)
class BenchServeConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 0
    # Distinct shared prefixes (families), one drawn at random per prompt.
    num_prefixes: int = 1
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    # SLOs in seconds, keys from metrics.SLO_KEYS
    goodput: dict[str, float] = field(default_factory=dict)
    api_key: str | None = None
    tokenizer: str | None = None
    disable_tqdm: bool = False
    # NOTE: bounds the whole request (connect to last byte), so a server that
    # stalls mid-stream cannot keep the benchmark from ending.
    request_timeout_s: float = 600.0

    def validate(self) -> None:
        if "chat/completions" in self.endpoint:
            raise ConfigError("--endpoint", self.endpoint, "a completions endpoint such as /v1/completions")
        if not (self.request_rate > 0):
            raise ConfigError("--request-rate", self.request_rate, "a positive number or inf")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("--max-concurrency", self.max_concurrency, "an integer >= 1")
        if not (self.request_timeout_s > 0):
            raise ConfigError("--request-timeout", self.request_timeout_s, "a positive number of seconds")


@dataclass
class BenchmarkResult:
    config: BenchServeConfig
    model: str
    started_at: str
    metrics: BenchmarkMetrics
    records: list[RequestRecord]

    def to_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        config.pop("api_key")  # never write a secret into a result file
        # JSON has no Infinity; keep the file strict.
        config["request_rate"] = "inf" if math.isinf(self.config.request_rate) else self.config.request_rate
        config["goodput"] = {key: limit * 1000.0 for key, limit in self.config.goodput.items()}
        return {
            "date": self.started_at,
            "backend": "openai-completions",
            "model": self.model,
            "config": config,
            **flatten_metrics(self.metrics),
            "requests": [record.to_json() for record in self.records],
        }


def flatten_metrics(metrics: BenchmarkMetrics) -> dict[str, Any]:
    """vLLM's result-file names (``mean_ttft_ms``, ``median_ttft_ms``, ...) so files compare."""
    flat: dict[str, Any] = {}
    for key, value in asdict(metrics).items():
        if key.endswith("_ms"):
            name = key.removesuffix("_ms")
            flat[f"mean_{name}_ms"] = value["mean"]
            flat[f"median_{name}_ms"] = value["p50"]
            flat[f"p99_{name}_ms"] = value["p99"]
        else:
            flat[key] = value
    return flat


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process; all 0 for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    # NOTE: its own RNG, so the schedule does not shift when the dataset changes.
    rng = random.Random(f"arrivals-{seed}")
    offsets: list[float] = []
    now = 0.0
    for index in range(num_requests):
        if index > 0:
            now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_default_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model id the server lists, as vLLM's benchmark does without --model."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise BenchmarkError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise BenchmarkError(f"GET {url} answered {response.status_code}: {response.text[:300]}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchmarkError(f"GET {url} listed no model; pass --model ({response.text[:300]})") from exc


def completion_payload(model: str, request: BenchRequest) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        # Fixed output lengths: the benchmark measures serving, not where EOS falls.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    headers: dict[str, str],
    bench_start: float,
) -> None:
    """Stream one completion, filling `record`. Never raises for what the server does."""
    import httpx

    sent = time.perf_counter()
    record.start_time = sent - bench_start
    last_chunk = sent
    saw_done = False
    finish_reason: str | None = None
    text_parts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    saw_done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"chunk is not a JSON object: {data[:100]}")
                if chunk.get("error"):
                    record.error = f"error chunk: {json.dumps(chunk['error'])[:300]}"
                    return
                now = time.perf_counter()
                if choices := chunk.get("choices"):
                    # A chunk carrying a choice carries tokens, even when its text is
                    # empty (a detokenizer holding back a partial UTF-8 character).
                    if record.num_chunks == 0:
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last_chunk)
                    last_chunk = now
                    record.num_chunks += 1
                    text_parts.append(choices[0].get("text") or "")
                    finish_reason = choices[0].get("finish_reason") or finish_reason
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
                    record.output_tokens_from_usage = True
                    if usage.get("prompt_tokens") is not None:
                        record.prompt_len = int(usage["prompt_tokens"])
    except (httpx.HTTPError, ValueError) as exc:  # transport errors, broken streams, bad JSON
        record.error = f"{type(exc).__name__}: {exc}"[:300]
        return
    finally:
        # also on failure and on a timeout's cancellation: a failed record says how long it took
        record.e2e = time.perf_counter() - sent
    record.generated_text = "".join(text_parts)
    if not saw_done:
        record.error = "stream ended before data: [DONE]"
    elif record.num_chunks == 0:
        record.error = "stream carried no tokens"
    elif finish_reason == "abort":
        record.error = "finish_reason=abort"
    else:
        if not record.output_tokens_from_usage:
            record.output_tokens = record.num_chunks
        record.success = True


async def run_benchmark(config: BenchServeConfig) -> BenchmarkResult:
    """Run the whole benchmark; ends after every request finished, failed or timed out."""
    import httpx

    config.validate()
    pool = token_id_pool(config.tokenizer)
    requests = sample_random_requests(config.num_prompts, config.input_len, config.output_len,
                                      config.prefix_len, config.seed, pool, config.num_prefixes)
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    headers = _headers(config.api_key)
    url = config.base_url.rstrip("/") + "/" + config.endpoint.lstrip("/")
    # NOTE: httpx pools 100 connections by default; queueing there would be
    # counted as TTFT, so the pool is as large as the concurrency allowed.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout_s)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = config.model or await fetch_default_model(client, config.base_url, config.api_key)
        records = [RequestRecord(index=i, prompt_len=len(r.prompt_token_ids), output_len_requested=r.output_len)
                   for i, r in enumerate(requests)]
        progress = _progress_bar(len(requests), config.disable_tqdm)
        started_at = datetime.now(UTC).isoformat()
        bench_start = time.perf_counter()

        async def issue(index: int) -> None:
            await asyncio.sleep(max(0.0, bench_start + offsets[index] - time.perf_counter()))
            async with semaphore if semaphore is not None else contextlib.nullcontext():
                record = records[index]
                try:
                    await asyncio.wait_for(
                        send_completion(client, url, completion_payload(model, requests[index]), record,
                                        headers, bench_start),
                        timeout=config.request_timeout_s,
                    )
                except TimeoutError:
                    record.error = f"timed out after {config.request_timeout_s:g} s"
                    record.success = False
            progress.update(1)

        try:
            await asyncio.gather(*(issue(index) for index in range(len(requests))))
        finally:
            progress.close()
        duration = time.perf_counter() - bench_start

    metrics = compute_metrics(records, duration, config.goodput)
    return BenchmarkResult(config=config, model=model, started_at=started_at, metrics=metrics, records=records)


def _progress_bar(total: int, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=disable, desc="requests", file=sys.stderr)


# ---- report ------------------------------------------------------------


def format_report(result: BenchmarkResult) -> str:
    metrics, config = result.metrics, result.config
    width = 50

    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40}{value:>10}"

    def section(title: str) -> str:
        return f" {title} ".center(width, "-")

    lines = [
        " Serving Benchmark Result ".center(width, "="),
        row("Model:", result.model),
        row("Successful requests:", metrics.completed),
        row("Failed requests:", metrics.failed),
        row("Request rate configured (RPS):", "inf" if math.isinf(config.request_rate) else config.request_rate),
        row("Maximum request concurrency:", config.max_concurrency if config.max_concurrency else "none"),
        row("Benchmark duration (s):", metrics.duration_s),
        row("Total input tokens:", metrics.total_input_tokens),
        row("Total generated tokens:", metrics.total_output_tokens),
        row("Request throughput (req/s):", metrics.request_throughput),
        row("Output token throughput (tok/s):", metrics.output_throughput),
        row("Total token throughput (tok/s):", metrics.total_token_throughput),
    ]
    if metrics.goodput is not None:
        slos = ", ".join(f"{key}<={limit * 1000:g}ms" for key, limit in config.goodput.items())
        lines.append(row("SLOs:", slos))
        lines.append(row("Good requests (met every SLO):", metrics.good_completions))
        lines.append(row("Request goodput (req/s):", metrics.goodput))
    latency: list[tuple[str, str, LatencyStats]] = [
        ("Time to First Token", "TTFT", metrics.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms),
        ("Inter-token Latency", "ITL", metrics.itl_ms),
        ("End-to-end Latency", "E2E", metrics.e2e_ms),
    ]
    for title, short, stats in latency:
        lines += [
            section(title),
            row(f"Mean {short} (ms):", stats.mean),
            row(f"Median {short} (ms):", stats.p50),
            row(f"P99 {short} (ms):", stats.p99),
        ]
    lines.append("=" * width)
    errors = sorted({record.error for record in result.records if record.error})
    if errors:
        lines.append("Errors (distinct):")
        lines += [f"  {error}" for error in errors[:10]]
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------


def _request_rate(value: str) -> float:
    rate = float(value)  # float() already accepts "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a positive number or inf")
    return rate


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: an integer >= 1")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: an integer >= 0")
    return number


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench serve`` to the ``pagedllm`` command's subparsers."""
    bench = sub.add_parser("bench", allow_abbrev=False, help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser(
        "serve", allow_abbrev=False, help="load-test an OpenAI-compatible server (pagedllm, vLLM, ...)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    serve.add_argument("--endpoint", default="/v1/completions")
    serve.add_argument("--num-prompts", type=_positive_int, default=100)
    serve.add_argument("--input-len", type=_positive_int, default=128,
                       help="random prompt tokens per request, after the shared prefix")
    serve.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens (with ignore_eos)")
    serve.add_argument("--prefix-len", type=_non_negative_int, default=0,
                       help="tokens of a prefix shared by every prompt")
    serve.add_argument("--num-prefixes", type=_positive_int, default=1,
                       help="distinct prefixes of --prefix-len tokens, one drawn at random per prompt "
                            "(prompt families: what cache-aware routing is measured on)")
    serve.add_argument("--request-rate", type=_request_rate, default=math.inf,
                       help="Poisson arrival rate in requests/s; inf sends all at once (default)")
    serve.add_argument("--max-concurrency", type=_positive_int, default=None,
                       help="at most this many requests in flight")
    serve.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    serve.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                       help="SLOs for goodput, e.g. ttft:200 tpot:50 e2e:2000 (milliseconds)")
    serve.add_argument("--result-file", default=None, help="write the result and every request as JSON here")
    serve.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    serve.add_argument("--tokenizer", default=None,
                       help="draw prompt ids from this tokenizer's vocabulary (default: ids 10-499)")
    serve.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds one request may take in all before it counts as failed")
    serve.add_argument("--disable-tqdm", action="store_true")
    serve.set_defaults(func=cmd_bench_serve)


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    return BenchServeConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        goodput=parse_goodput(args.goodput),
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        disable_tqdm=args.disable_tqdm,
        request_timeout_s=args.request_timeout,
    )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    result = asyncio.run(run_benchmark(config))
    print(format_report(result))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as handle:
            json.dump(result.to_json(), handle, indent=2)
    return 0
