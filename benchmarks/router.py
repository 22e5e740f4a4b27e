"""Cache-aware routing against load-only routing: `pagedllm router` over two
`pagedllm serve` backends, one run per policy, same workload, same run.

Workload (`pagedllm bench serve`'s random dataset with prompt families): 16
prefixes of 1,000 tokens, 256 requests each drawing one at random, plus 32
random tokens, 16 output tokens (ignore_eos), Poisson arrivals. The shipped
tiny model in float32; each backend gets one core (OMP_NUM_THREADS=1) and
`--num-kv-blocks` that hold about half the families' prefixes: a router that
keeps each family on one backend gives each backend half the families to
cache; one that spreads them makes both backends cache all of them.

Each policy starts fresh backends (empty caches) and its own router. The
table shows the backends' prefix-cache hit rate (from their /metrics),
TTFT p50/p99, output tok/s, and TTFT p50 over round_robin's.

    .venv/bin/python benchmarks/router.py [--num-prompts 256] [--request-rate 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pagedllm.entrypoints.bench.serve import BenchServeConfig, run_benchmark

POLICIES = ("round_robin", "least_loaded", "prefix_aware")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _process(args: list[str], env: dict[str, str] | None = None) -> Iterator[str]:
    """`pagedllm <args>` on a free 127.0.0.1 port, healthy; its URL. Stopped by pid."""
    port = _free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", *args, "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.NamedTemporaryFile(prefix="pagedllm-bench-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start:\n{Path(log.name).read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.unlink(log.name)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, float]:
    backend_args = ["serve", "tiny", "--dtype", "float32", "--num-kv-blocks", str(args.num_kv_blocks),
                    "--enable-kv-events", "--log-stats-interval-s", "0"]
    one_core = {"OMP_NUM_THREADS": "1"}
    with _process(backend_args, one_core) as first, _process(backend_args, one_core) as second:
        with _process(["router", "--backend", first, "--backend", second, "--policy", policy]) as router:
            config = BenchServeConfig(
                base_url=router, num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                request_rate=args.request_rate, seed=args.seed, disable_tqdm=True,
            )
            result = asyncio.run(run_benchmark(config))
        texts = [httpx.get(url + "/metrics").text for url in (first, second)]
    hits = sum(_metric(text, "pagedllm:prefix_cache_hits_total") for text in texts)
    queries = sum(_metric(text, "pagedllm:prefix_cache_queries_total") for text in texts)
    metrics = result.metrics
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": metrics.ttft_ms.p50,
        "ttft_p99_ms": metrics.ttft_ms.p99,
        "output_tok_s": metrics.output_throughput,
        "failed": float(metrics.failed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--num-kv-blocks", type=int, default=600, help="per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    rows = {policy: run_policy(policy, args) for policy in args.policies.split(",")}
    reference = rows.get("round_robin", next(iter(rows.values())))["ttft_p50_ms"]
    print(f"{args.num_prompts} requests, {args.num_prefixes} prefixes x {args.prefix_len} tokens "
          f"+ {args.input_len}, {args.output_len} out, {args.request_rate} req/s, 2 backends")
    print(f"{'policy':<14} {'hit rate':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'out tok/s':>10} "
          f"{'p50 vs rr':>10} {'failed':>7}")
    for policy, row in rows.items():
        print(f"{policy:<14} {row['hit_rate']:>9.3f} {row['ttft_p50_ms']:>8.1f}ms {row['ttft_p99_ms']:>8.1f}ms "
              f"{row['output_tok_s']:>10.1f} {reference / row['ttft_p50_ms']:>9.2f}x {row['failed']:>7.0f}")


if __name__ == "__main__":
    main()
