"""Soak: rounds of mixed traffic against `pagedllm serve`, then check that
nothing is left behind (no running or waiting request, no KV block in use) and
that neither process keeps growing.

Each round sends N requests from C concurrent httpx clients: a fixed-seed mix
of completions and chat, streaming and not, n in {1, 2, 4}, a few multi-prompt
completions, structured output (a JSON schema through `response_format`, a
regex or a choice through `structured_outputs`), stop strings, logprobs, and a
share aborted by disconnect (a stream closed after a chunk or two, a
non-streaming request dropped by a short read timeout). Every round draws new
prompts and grammars, so a cache that is not bounded shows up as growth.

After each round the script waits until the server is idle, reads /metrics and
the RSS of the API process and of the engine-core process (pids from
/server_info, VmRSS from /proc), and prints one table row. A CPU engine's RSS
also grows as KV blocks are written for the first time (the pool is a fresh
mapping, paged in as used): that is not a leak, so the row shows the KV
cache's resident bytes (/memory_usage: its pages in RAM) apart, and the rule
looks at the rest. Round 1 is warm-up; from round 2 on, the API process's RSS
and the engine's RSS minus resident KV may each grow at most
--max-rss-growth-mb per round (the engine's whole RSS where resident KV is
unknown). Exit 0 when every round had no error, ended idle and stayed within
the growth limit; 1 otherwise.

    .venv/bin/python benchmarks/soak.py [--model tiny | --base-url http://127.0.0.1:8000]
        [--rounds 3] [--num-requests 600] [--concurrency 16] [--max-rss-growth-mb 8]
        [--serve-args "--num-kv-blocks 512"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WORDS = (
    "def return import self class for in range print value result items data os path len list dict None "
    "True False if else while try except with open read write name key index count total self.cache"
).split()
SHARED_PREFIX = "import os\nimport sys\n\n\n"  # a third of the prompts share it, so prefix caching is exercised
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SoakRequest:
    path: str
    body: dict[str, Any]
    num_choices: int
    # Disconnect plans: close the stream after this many chunks, or drop a
    # non-streaming request when no byte came back within this many seconds.
    abort_after_chunks: int | None = None
    abort_after_s: float | None = None
    # ("json" | "regex" | "choice", argument): checked on choices that finished with "stop".
    check: tuple[str, Any] | None = None
    tags: tuple[str, ...] = ()


@dataclass
class Outcome:
    latency_s: float | None = None  # set only for requests that completed with a valid body
    error: str | None = None  # "500", "timeout", "bad-body", ...
    aborted: bool = False
    detail: str = ""
    request: SoakRequest | None = None  # for the error and slowest-request lines


@dataclass
class RoundResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


def _prompt(rng: random.Random) -> str:
    words = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
    return SHARED_PREFIX + words if rng.random() < 0.33 else words


def make_request(rng: random.Random, model: str, max_tokens: int, abort_max_tokens: int,
                 abort_share: float) -> SoakRequest:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = rng.choice((1, 1, 2, 4))
    tags = ["chat" if chat else "completion", "stream" if stream else "non-stream"]
    body: dict[str, Any] = {"model": model, "n": n, "stream": stream, "max_tokens": rng.randint(1, max_tokens)}
    if n > 1:
        tags.append("n>1")
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, seed=rng.randrange(2**31))
    num_prompts = 1
    if chat:
        messages = [{"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You write Python."})
        body["messages"] = messages
    elif rng.random() < 0.1:
        num_prompts = rng.randint(2, 3)
        body["prompt"] = [_prompt(rng) for _ in range(num_prompts)]
        tags.append("multi-prompt")
    else:
        body["prompt"] = _prompt(rng)

    check: tuple[str, Any] | None = None
    draw = rng.random()
    if draw < 0.25:
        kind = rng.choice(("json", "regex", "choice"))
        tags.append(f"structured:{kind}")
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}
            check = ("json", None)
        elif kind == "regex":
            # Fresh words each time: new grammars keep reaching the compiler and its cache.
            pattern = f"({'|'.join(rng.sample(WORDS, 2))})-[0-9]{{1,{rng.randint(1, 4)}}}"
            body["structured_outputs"] = {"regex": pattern}
            check = ("regex", pattern)
        else:
            options = rng.sample(WORDS, rng.randint(2, 4))
            body["structured_outputs"] = {"choice": options}
            check = ("choice", options)
    elif draw < 0.45:
        body["stop"] = rng.sample(["\n", ")", ":", "return", " ="], rng.randint(1, 2))
        tags.append("stop")
    if rng.random() < 0.2:
        if chat:
            body.update(logprobs=True, top_logprobs=2)
        else:
            body["logprobs"] = rng.choice((0, 1, 3))
        tags.append("logprobs")

    abort_after_chunks = abort_after_s = None
    if rng.random() < abort_share:
        # Long and without EOS, so the disconnect lands mid-generation.
        body.update(max_tokens=abort_max_tokens, ignore_eos=True)
        body.pop("stop", None)
        if stream:
            abort_after_chunks = rng.randint(1, 2)
        else:
            abort_after_s = rng.uniform(0.05, 0.5)
        tags.append("abort")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return SoakRequest(path, body, num_prompts * n, abort_after_chunks, abort_after_s, check, tuple(tags))


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    part = choice.get("message") or choice.get("delta") or {}
    return str(part.get("content") or "")


def check_choices(request: SoakRequest, texts: dict[int, str], finishes: dict[int, str | None],
                  logprobs_seen: set[int]) -> str | None:
    """What is wrong with a completed response, or None."""
    if sorted(finishes) != list(range(request.num_choices)):
        return f"choice indexes {sorted(finishes)}, expected 0..{request.num_choices - 1}"
    for index, reason in finishes.items():
        if reason not in FINISH_REASONS:
            return f"choice {index}: finish_reason={reason!r}"
        text = texts.get(index, "")
        if "logprobs" in request.tags and not request.body.get("stream") and index not in logprobs_seen:
            return f"choice {index}: logprobs requested but missing"
        if request.check is None or reason != "stop":
            continue
        kind, argument = request.check
        if kind == "json":
            try:
                json.loads(text)
            except ValueError:
                return f"choice {index}: finished 'stop' but is not JSON: {text[:80]!r}"
        elif kind == "regex" and not re.fullmatch(argument, text):
            return f"choice {index}: {text[:80]!r} does not match {argument!r}"
        elif kind == "choice" and text not in argument:
            return f"choice {index}: {text[:80]!r} not in {argument}"
    return None


async def _send_streaming(client: httpx.AsyncClient, request: SoakRequest, start: float) -> Outcome:
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    chunks = 0
    async with client.stream("POST", request.path, json=request.body) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            return Outcome(error=str(response.status_code), detail=body[:200])
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                problem = check_choices(request, texts, finishes, set())
                if problem:
                    return Outcome(error="bad-body", detail=problem)
                return Outcome(latency_s=time.perf_counter() - start)
            chunk = json.loads(payload)
            if "error" in chunk:
                return Outcome(error="error-event", detail=payload[:200])
            chunks += 1
            for choice in chunk.get("choices", []):
                index = choice["index"]
                texts[index] = texts.get(index, "") + _choice_text(choice)
                if choice.get("finish_reason") is not None:
                    finishes[index] = choice["finish_reason"]
            if request.abort_after_chunks is not None and chunks >= request.abort_after_chunks:
                return Outcome(aborted=True)  # leaving the block closes the connection mid-stream
    return Outcome(error="bad-body", detail=f"stream ended without [DONE] after {chunks} chunks")


async def _send_plain(client: httpx.AsyncClient, request: SoakRequest, start: float) -> Outcome:
    timeout = client.timeout
    if request.abort_after_s is not None:
        timeout = httpx.Timeout(timeout.connect, read=request.abort_after_s, write=timeout.write, pool=timeout.pool)
    try:
        response = await client.post(request.path, json=request.body, timeout=timeout)
    except httpx.ReadTimeout:
        if request.abort_after_s is not None:
            return Outcome(aborted=True)
        raise
    if response.status_code != 200:
        return Outcome(error=str(response.status_code), detail=response.text[:200])
    choices = response.json().get("choices", [])
    texts = {c["index"]: _choice_text(c) for c in choices}
    finishes = {c["index"]: c.get("finish_reason") for c in choices}
    logprobs_seen = {c["index"] for c in choices if c.get("logprobs") is not None}
    problem = check_choices(request, texts, finishes, logprobs_seen)
    if problem:
        return Outcome(error="bad-body", detail=problem)
    return Outcome(latency_s=time.perf_counter() - start)


async def send(client: httpx.AsyncClient, request: SoakRequest, timeout_s: float) -> Outcome:
    start = time.perf_counter()
    sender = _send_streaming if request.body["stream"] else _send_plain
    try:
        # NOTE: httpx timeouts bound each read, not the whole stream; this bounds the request.
        return await asyncio.wait_for(sender(client, request, start), timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        return Outcome(error="timeout", detail=f"{request.path} {request.tags}")
    except httpx.TransportError as exc:
        return Outcome(error=f"transport:{type(exc).__name__}", detail=str(exc)[:200])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a body or chunk of the wrong shape
        return Outcome(error="bad-body", detail=f"{type(exc).__name__}: {exc}"[:200])


async def run_round(base_url: str, headers: dict[str, str], requests: list[SoakRequest], concurrency: int,
                    timeout_s: float, round_timeout_s: float) -> RoundResult:
    outcomes: list[Outcome | None] = [None] * len(requests)
    pending = iter(range(len(requests)))
    deadline = time.monotonic() + round_timeout_s

    async def client_loop() -> None:
        # One client (one connection) per concurrent user, as C separate clients would be.
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as client:
            for index in pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    outcomes[index] = Outcome(error="round-deadline")
                    continue
                outcome = await send(client, requests[index], min(timeout_s, left))
                outcome.request = requests[index]
                outcomes[index] = outcome

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return RoundResult([o or Outcome(error="not-sent") for o in outcomes], time.perf_counter() - start)


def scrape(client: httpx.Client) -> dict[str, float]:
    """Sum of each /metrics sample over its labels, plus `name{finished_reason=abort}`-style keys."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    response.raise_for_status()
    totals: dict[str, float] = Counter()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            totals[sample.name] += sample.value
            if "finished_reason" in sample.labels:
                totals[f"{sample.name}{{{sample.labels['finished_reason']}}}"] += sample.value
    return totals


def wait_idle(client: httpx.Client, timeout_s: float) -> tuple[bool, dict[str, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(client)
        state = [metrics.get(f"pagedllm:{name}", math.nan)
                 for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if state == [0, 0, 0]:
            return True, metrics
        if time.monotonic() > deadline:
            return False, metrics
        time.sleep(0.2)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _describe(request: SoakRequest | None) -> str:
    if request is None:
        return "-"
    body = request.body
    return f"{request.path} {','.join(request.tags)} n={body['n']} max_tokens={body['max_tokens']}"


def report_outliers(round_index: int, outcomes: list[Outcome]) -> None:
    """The first errors and the slowest completed requests, on stderr: what to look at when a row is odd."""
    for outcome in [o for o in outcomes if o.error][:5]:
        print(f"  round {round_index} error {outcome.error}: {outcome.detail} [{_describe(outcome.request)}]",
              file=sys.stderr)
    completed = sorted((o for o in outcomes if o.latency_s is not None), key=lambda o: -(o.latency_s or 0))
    for outcome in completed[:3]:
        print(f"  round {round_index} slow {outcome.latency_s:.2f} s [{_describe(outcome.request)}]", file=sys.stderr)


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _growth(now: float | None, before: float | None) -> str:
    return "n/a" if now is None or before is None else f"{now - before:+.1f}"


TABLE_HEADER = (
    "| round | requests | errors | aborted (seqs) | abort metric Δ | p50 s | p99 s | running/waiting after "
    "| KV usage after | API RSS MB | API Δ MB | engine RSS MB | engine KV resident MB | engine RSS - KV MB "
    "| engine Δ (RSS - KV) MB | wall s |\n"
    "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def kv_resident_mb(client: httpx.Client, engine_pid: int | None) -> float | None:
    """The KV cache's pages in RAM in the engine-core process (its ranks
    that live there), from /memory_usage; None when unknown."""
    try:
        response = client.get("/memory_usage")
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or engine_pid is None:
        return None
    ranks = [rank for rank in response.json()["ranks"] if rank["pid"] == engine_pid]
    if not ranks or any(rank["kv_cache_resident_bytes"] < 0 for rank in ranks):
        return None
    return sum(rank["kv_cache_resident_bytes"] for rank in ranks) / (1 << 20)


@dataclass(frozen=True)
class RoundState:
    """What the server looked like once a round was over."""

    idle: bool
    metrics: dict[str, float]
    rss: tuple[float | None, float | None]  # API process, engine-core process
    kv_resident: float | None = None  # MB of the KV cache in RAM, in the engine-core process

    @property
    def engine_rest(self) -> float | None:
        """The engine's RSS less its resident KV (what the leak rule looks at)."""
        engine = self.rss[1]
        return None if engine is None or self.kv_resident is None else engine - self.kv_resident

    def gauge(self, name: str) -> float:
        return self.metrics.get(f"pagedllm:{name}", math.nan)

    @property
    def aborts(self) -> float:
        return self.metrics.get("pagedllm:request_success_total{abort}", 0.0)


def summarize_round(round_index: int, result: RoundResult, state: RoundState, before: RoundState,
                    args: argparse.Namespace) -> tuple[str, list[str]]:
    """The table row and the failures of one round."""
    outcomes = result.outcomes
    errors = Counter(o.error for o in outcomes if o.error)
    latencies = [o.latency_s for o in outcomes if o.latency_s is not None]
    # The engine counts an abort per sequence (prompts x n), so the row shows both for comparison.
    aborted = sum(o.aborted for o in outcomes)
    aborted_seqs = sum(o.request.num_choices for o in outcomes if o.aborted and o.request)
    running, waiting, kv_usage = (state.gauge(name) for name in
                                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    error_text = str(sum(errors.values()))
    if errors:
        error_text += " (" + ", ".join(f"{kind}: {count}" for kind, count in sorted(errors.items())) + ")"
    row = (f"| {round_index} | {len(outcomes)} | {error_text} | {aborted} ({aborted_seqs}) | "
           f"{state.aborts - before.aborts:.0f} | {percentile(latencies, 0.5):.2f} | "
           f"{percentile(latencies, 0.99):.2f} | {running:.0f}/{waiting:.0f} | {kv_usage:.3f} | "
           f"{_mb(state.rss[0])} | {_growth(state.rss[0], before.rss[0])} | {_mb(state.rss[1])} | "
           f"{_mb(state.kv_resident)} | {_mb(state.engine_rest)} | "
           f"{_growth(*_comparable(state, before))} | {result.wall_s:.1f} |")
    failures = []
    if errors:
        failures.append(f"round {round_index}: {sum(errors.values())} errors {dict(errors)}")
    if not state.idle:
        failures.append(f"round {round_index}: not idle {args.idle_timeout_s} s after the last request "
                        f"(running {running}, waiting {waiting}, KV usage {kv_usage})")
    if round_index > 1:  # round 1 is warm-up: allocator pools, grammar caches, lazy imports
        engine_name = "engine RSS" if state.engine_rest is None else "engine RSS less resident KV"
        engine_now, engine_then = _comparable(state, before)
        for name, now, then in (("API RSS", state.rss[0], before.rss[0]), (engine_name, engine_now, engine_then)):
            if now is not None and then is not None and now - then > args.max_rss_growth_mb:
                failures.append(f"round {round_index}: {name} grew {now - then:.1f} MB "
                                f"(> {args.max_rss_growth_mb} MB)")
    return row, failures


def _comparable(state: RoundState, before: RoundState) -> tuple[float | None, float | None]:
    """The engine's figure now and before, measured the same way: RSS less
    resident KV when both rounds know it, else the whole RSS."""
    if state.engine_rest is not None and before.engine_rest is not None:
        return state.engine_rest, before.engine_rest
    return state.rss[1], before.rss[1]


def soak(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> int:
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        info = client.get("/server_info").json()
        pids = (info["api_pid"], info.get("engine_pid"))
        model, max_model_len = info["model"], int(info["max_model_len"])
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        # Prompts stay under ~120 tokens; the aborted requests must still fit.
        abort_max_tokens = max(args.max_tokens, min(256, max_model_len - 160))
        plans = [[make_request(random.Random(f"{args.seed}-{round_index}-{i}"), model_id, args.max_tokens,
                               abort_max_tokens, args.abort_share) for i in range(args.num_requests)]
                 for round_index in range(args.rounds)]
        mix = Counter(tag for request in plans[0] for tag in request.tags)
        print(f"# Soak: {args.rounds} rounds x {args.num_requests} requests at concurrency {args.concurrency}, "
              f"seed {args.seed}, model {model} (max_model_len {max_model_len}), {base_url}\n")
        print("Mix in round 1: " + ", ".join(f"{tag} {count}" for tag, count in sorted(mix.items())) + "\n")
        print(TABLE_HEADER)
        before = RoundState(True, scrape(client), (rss_mb(pids[0]), rss_mb(pids[1])), kv_resident_mb(client, pids[1]))
        print(f"| start | | | | | | | | | {_mb(before.rss[0])} | | {_mb(before.rss[1])} | {_mb(before.kv_resident)} "
              f"| {_mb(before.engine_rest)} | | |", flush=True)
        failures: list[str] = []
        for round_index, requests in enumerate(plans, start=1):
            result = asyncio.run(run_round(base_url, headers, requests, args.concurrency, args.request_timeout_s,
                                           args.round_timeout_s))
            try:
                idle, metrics = wait_idle(client, args.idle_timeout_s)
            except httpx.HTTPError as exc:
                failures.append(f"round {round_index}: /metrics unreadable after the round ({exc!r})")
                break
            state = RoundState(idle, metrics, (rss_mb(pids[0]), rss_mb(pids[1])), kv_resident_mb(client, pids[1]))
            row, round_failures = summarize_round(round_index, result, state, before, args)
            print(row, flush=True)
            report_outliers(round_index, result.outcomes)
            failures += round_failures
            before = state
            if not idle:
                break  # later rounds would measure a server that is still busy
    if None in before.rss:
        print("\nRSS of a process was not readable (n/a): its growth was not checked.")
    if before.kv_resident is None:
        print("\nThe engine's resident KV was unknown (n/a): its whole RSS was checked.")
    if args.rounds < 2:
        print("\nRSS growth not checked: it needs at least 2 rounds (round 1 is warm-up).")
    if failures:
        print("\nFAIL: " + "; ".join(failures))
        return 1
    growth = (f", growth after round 1 within {args.max_rss_growth_mb} MB per round for both processes "
              "(API RSS; engine RSS less resident KV)" if args.rounds > 1 else "")
    print(f"\nPASS: no errors, idle with KV usage 0 after every round{growth}.")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded default model)")
    parser.add_argument("--base-url", default=None, help="attach to a running server on 127.0.0.1 instead")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one shell-quoted string")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32, help="upper bound of a normal request's max_tokens")
    parser.add_argument("--abort-share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--round-timeout-s", type=float, default=1800.0)
    parser.add_argument("--idle-timeout-s", type=float, default=30.0)
    parser.add_argument("--max-rss-growth-mb", type=float, default=8.0)
    args = parser.parse_args()
    if min(args.rounds, args.num_requests, args.concurrency, args.max_tokens) < 1:
        parser.error("--rounds, --num-requests, --concurrency and --max-tokens must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.base_url is not None:
        if urlsplit(args.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--base-url {args.base_url}: only a loopback server may be soaked")
        return soak(args, args.base_url.rstrip("/"), headers)

    from helpers.server import start_server

    with start_server(args.model, *shlex.split(args.serve_args), api_key=args.api_key) as server:
        code = soak(args, server.base_url, headers)
        if server.process.poll() is not None:
            print(f"server exited with {server.process.returncode}", file=sys.stderr)
            code = 1
        if code != 0:  # the server's own account of what went wrong, while its log still exists
            print("--- server log (last 40 lines) ---\n" + "\n".join(server.log().splitlines()[-40:]), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
