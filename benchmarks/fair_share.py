"""Fair sharing, as a client sees it: one monopolising request beside a small one.

One client sends a request at the pending limit (by default 8 prompts x n=128
= 1,024 sequences, exactly `server.max_pending_requests`); meanwhile a second
client sends a 2-token request every --interval-s seconds. The script prints
each small request's status and latency, and the big request's. Before fair
sharing the small requests got 503 for the big one's whole lifetime (or, at
512 sequences, no answer for minutes); the bound is --bound-s (15 s).

Exit 0 when every small request was answered 200 within the bound, 1 otherwise.
Once the small requests are done (--num-small), the big one is aborted
(its connection closed) unless --wait-big is given.

    .venv/bin/python benchmarks/fair_share.py [--model tiny | --base-url http://127.0.0.1:8000]
        [--num-prompts 8] [--n 128] [--max-tokens 256] [--num-small 10] [--interval-s 3]
        [--serve-args "--num-kv-blocks 4096"]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


@dataclass
class Answer:
    sent_at_s: float  # since the big request was sent
    status: int | str
    latency_s: float
    completion_tokens: int | None = None


async def post(client: httpx.AsyncClient, body: dict[str, object], origin: float) -> Answer:
    start = time.monotonic()
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return Answer(start - origin, type(exc).__name__, time.monotonic() - start)
    latency_s = time.monotonic() - start
    tokens = response.json().get("usage", {}).get("completion_tokens") if response.status_code == 200 else None
    return Answer(start - origin, response.status_code, latency_s, tokens)


async def run(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> tuple[Answer | None, list[Answer]]:
    timeout = httpx.Timeout(args.request_timeout_s, connect=30)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as big_client, \
            httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as small_client:
        model = (await small_client.get("/v1/models")).json()["data"][0]["id"]
        big_body = {"model": model, "prompt": [f"Request {index}: write a story" for index in range(args.num_prompts)],
                    "n": args.n, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": 0}
        origin = time.monotonic()
        big = asyncio.create_task(post(big_client, big_body, origin))
        await asyncio.sleep(args.first_delay_s)  # the big request is admitted first
        small_answers = []
        for index in range(args.num_small):
            body = {"model": model, "prompt": f"small {index}", "max_tokens": 2, "ignore_eos": True}
            small_answers.append(await post(small_client, body, origin))
            answer = small_answers[-1]
            print(f"| {index + 1} | {answer.sent_at_s:.1f} | {answer.status} | {answer.latency_s:.2f} | "
                  f"{'yes' if not big.done() else 'no'} |", flush=True)
            await asyncio.sleep(max(0.0, args.interval_s - answer.latency_s))
        if args.wait_big:
            return await big, small_answers
        big_answer = big.result() if big.done() else None
        big.cancel()  # closes its connection: the server aborts it
        with contextlib.suppress(asyncio.CancelledError):
            await big
        return big_answer, small_answers


def report(args: argparse.Namespace, big: Answer | None, small: list[Answer]) -> int:
    statuses = [answer.status for answer in small]
    latencies = sorted(answer.latency_s for answer in small)
    ok = all(status == 200 for status in statuses) and latencies[-1] <= args.bound_s
    print(f"\nsmall requests: {len(small)}, status {dict(Counter(statuses))}, "
          f"latency p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s (bound {args.bound_s} s)")
    if big is None:
        print(f"big request ({args.num_prompts} x n={args.n} x {args.max_tokens} tokens): still running "
              "when the small ones were done; aborted")
    else:
        print(f"big request ({args.num_prompts} x n={args.n} x {args.max_tokens} tokens): status {big.status}, "
              f"{big.latency_s:.1f} s, {big.completion_tokens} tokens")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded default model)")
    parser.add_argument("--base-url", default=None, help="attach to a running server on 127.0.0.1 instead")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one shell-quoted string")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256, help="the big request's tokens per sequence")
    parser.add_argument("--num-small", type=int, default=10)
    parser.add_argument("--interval-s", type=float, default=3.0)
    parser.add_argument("--first-delay-s", type=float, default=2.0)
    parser.add_argument("--bound-s", type=float, default=15.0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument("--wait-big", action="store_true", help="wait for the big request to finish")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    print(f"# Fair share: {args.num_prompts} prompts x n={args.n} x {args.max_tokens} tokens beside "
          f"{args.num_small} small 2-token requests, one every {args.interval_s} s\n")
    print("| small # | sent at s | status | latency s | big still running |\n|---:|---:|---|---:|---|")
    if args.base_url is not None:
        if urlsplit(args.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--base-url {args.base_url}: only a loopback server")
        return report(args, *asyncio.run(run(args, args.base_url.rstrip("/"), headers)))

    from helpers.server import start_server

    with start_server(args.model, *shlex.split(args.serve_args), api_key=args.api_key) as server:
        return report(args, *asyncio.run(run(args, server.base_url, headers)))


if __name__ == "__main__":
    sys.exit(main())
