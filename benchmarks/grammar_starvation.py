"""Grammar starvation (issue 30, point 2): eight ~100-byte JSON schemas whose
`pattern` (`.{0,6000}`) runs into `structured_output.compile_timeout_s`,
sent at once by one client, beside plain completions and a trivial
structured request; prints a table of every request's status and latency.

The bound: plain completions delayed under 2 s. Results, before and after
the validator lane: docs/performance.md ("Structured output").

    .venv/bin/python benchmarks/grammar_starvation.py [--model PATH]
        [--compile-timeout-s 10] [--num-slow 8] [--num-plain 5]
        [--base-url http://127.0.0.1:8000]

Without --base-url it starts `pagedllm serve` on 127.0.0.1 (a free port)
with the tiny test model (or --model) and stops it by pid afterwards; a
client's queue then holds all --num-slow specs (runs against a server
without the validator lane too, for a before/after table). Warm-up requests first start
the validator children (their cold start is not what is measured). Exit 0 if every plain completion and the trivial
structured request came back 200 within --bound-s; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PLAIN = {"prompt": "Hello", "max_tokens": 8}
TRIVIAL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def slow_schema(bound: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"text": {"type": "string", "pattern": f".{{0,{bound}}}"}},
            "required": ["text"]}


def structured(schema: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "JSON:", "max_tokens": 8, "structured_outputs": {"json": schema}}


async def timed(client: httpx.AsyncClient, url: str, name: str, body: dict[str, Any], started: float) -> list[Any]:
    sent = time.monotonic() - started
    try:
        response = await client.post(url, json=body)
        status: int | str = response.status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return [name, status, sent, time.monotonic() - started - sent]


async def run(base_url: str, args: argparse.Namespace) -> list[list[Any]]:
    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(timeout=args.client_timeout_s) as client:
        # Warm-up: a slow spec holds one validator child while a trivial one
        # starts the other (a child's cold start is seconds, and not the point).
        warm_slow = asyncio.ensure_future(client.post(url, json=structured(slow_schema(5999))))
        await asyncio.sleep(0.5)
        (await client.post(url, json=structured({"type": "object"}))).raise_for_status()
        await warm_slow
        started = time.monotonic()
        slow = [asyncio.ensure_future(timed(client, url, f"slow-pattern {index}", structured(slow_schema(6000 + index)),
                                            started)) for index in range(args.num_slow)]
        await asyncio.sleep(0.5)  # the slow ones are in first
        fast = [await timed(client, url, f"plain {index}", PLAIN, started) for index in range(args.num_plain)]
        fast.append(await timed(client, url, "trivial structured", structured(TRIVIAL_SCHEMA), started))
        return fast + list(await asyncio.gather(*slow))


def print_table(rows: list[list[Any]]) -> None:
    print(f"{'request':<22} {'status':>7} {'sent at s':>10} {'latency s':>10}")
    for name, status, sent, latency in rows:
        print(f"{name:<22} {status!s:>7} {sent:>10.2f} {latency:>10.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default=None, help="model to serve (default: the tiny test model)")
    parser.add_argument("--base-url", default=None, help="a running server instead of starting one")
    parser.add_argument("--compile-timeout-s", type=float, default=10.0)
    parser.add_argument("--num-slow", type=int, default=8)
    parser.add_argument("--num-plain", type=int, default=5)
    parser.add_argument("--bound-s", type=float, default=2.0, help="the latency bound of the fast requests")
    parser.add_argument("--client-timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    if args.base_url is not None:
        rows = asyncio.run(run(args.base_url, args))
    else:
        from helpers.server import start_server
        from helpers.tiny_models import cached_tiny_model

        model = args.model or cached_tiny_model("llama", with_tokenizer=True, seed=5)
        env = {"PAGEDLLM_STRUCTURED_OUTPUT__COMPILE_TIMEOUT_S": str(args.compile_timeout_s)}
        if args.num_slow > 8:  # the default queue holds 1 running + 7 waiting (+ 1 when none runs)
            env["PAGEDLLM_STRUCTURED_OUTPUT__MAX_QUEUED_COMPILES_PER_CLIENT"] = str(args.num_slow)
        with start_server(model, "--num-kv-blocks", "128", env=env) as server:
            rows = asyncio.run(run(server.base_url, args))
    print_table(rows)
    fast = [row for row in rows if not row[0].startswith("slow")]
    within = all(status == 200 and latency < args.bound_s for _, status, _, latency in fast)
    worst = max(latency for *_, latency in fast)
    print(f"\nslowest plain / trivial request: {worst:.2f} s (bound {args.bound_s:g} s): "
          f"{'ok' if within else 'OVER'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
