"""A large non-streaming response beside a /health poller.

Starts `pagedllm serve` on 127.0.0.1 (or attaches to one with --base-url),
polls GET /health every --poll-interval-s on its own connection, and sends
one non-streaming completion of n x max_tokens tokens with `logprobs` top
alternatives per token (ignore_eos, so every choice runs to max_tokens; the
defaults, n=128 x 1,500 x 20, make a ~107 MB body). Prints the body's size,
the request's time, the /health latencies while it ran (max and p99) and the
API process's resident memory before and at its peak (VmHWM).
Exit 0 when no /health answer took longer than --max-health-latency-s.

The server is started with --max-response-bytes (default 1 GiB) so that the
request is allowed: its worst-case estimate is several times its real size.
With --fake-engine the app runs in front of the tests' engine stand-in
(tests/helpers/fake_engine.py), which answers at once with n x max_tokens
copies of one token and its logprobs: the HTTP side alone, at full size,
in seconds (generating 192,000 tokens on a small CPU takes far longer).

    .venv/bin/python benchmarks/large_response.py [--n 128] [--max-tokens 1500] [--logprobs 20]
        [--serve-args "--num-kv-blocks 14000"] [--base-url http://127.0.0.1:8000] [--fake-engine]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


class HealthPoller:
    """GET /health every `interval_s` on its own connection, in a thread."""

    def __init__(self, base_url: str, interval_s: float) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.started_at: list[float] = []  # perf_counter() when each poll was sent
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - started)
                self.started_at.append(started)
                self.failures += not ok
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def run(args: argparse.Namespace, base_url: str) -> int:
    api_pid = httpx.get(f"{base_url}/server_info", timeout=30).json()["api_pid"]
    body = {"prompt": "The quick brown fox", "n": args.n, "max_tokens": args.max_tokens, "logprobs": args.logprobs,
            "ignore_eos": True, "temperature": 1.0, "seed": 0}
    content = json.dumps(body).encode()
    warm_up = json.dumps({**body, "n": 1, "max_tokens": 4}).encode()
    httpx.post(f"{base_url}/v1/completions", content=warm_up, headers={"content-type": "application/json"},
               timeout=600)
    rss_before = memory_kb(api_pid, "VmRSS")
    with HealthPoller(base_url, args.poll_interval_s) as poller:
        time.sleep(0.2)
        started = time.perf_counter()
        response = httpx.post(f"{base_url}/v1/completions", content=content,
                              headers={"content-type": "application/json"}, timeout=3600)
        elapsed = time.perf_counter() - started
        time.sleep(0.2)
    peak = memory_kb(api_pid, "VmHWM")
    slowest = sorted(zip(poller.latencies, poller.started_at, strict=True), reverse=True)[:3]
    latencies = sorted(poller.latencies)
    worst = latencies[-1] if latencies else float("nan")
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
    print(f"request: n={args.n} x max_tokens={args.max_tokens} x logprobs={args.logprobs}: "
          f"status {response.status_code}, {len(response.content) / 1e6:.1f} MB in {elapsed:.1f} s")
    if response.status_code != 200:
        print(response.text[:2000])
    print(f"/health: {len(latencies)} polls every {args.poll_interval_s * 1000:.0f} ms, max {worst * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, {poller.failures} failed")
    print("slowest /health polls (sent at, seconds after the request was): " + ", ".join(
        f"{latency * 1000:.0f} ms at {at - started:+.2f} s" for latency, at in slowest))
    print(f"API process: RSS {rss_before / 1024:.0f} MiB before, peak (VmHWM) {peak / 1024:.0f} MiB")
    ok = response.status_code == 200 and worst <= args.max_health_latency_s and poller.failures == 0
    print(("PASS" if ok else "FAIL") + f": /health never over {args.max_health_latency_s * 1000:.0f} ms")
    return 0 if ok else 1


def run_fake_engine(args: argparse.Namespace) -> int:
    from helpers.server import ServerProcess, _wait_for_health, free_port, stop_server

    port = free_port()
    script = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "fake_engine.py"
    command = [sys.executable, str(script), str(port), "--max-response-bytes", str(args.max_response_bytes)]
    with tempfile.NamedTemporaryFile(prefix="pagedllm-fake-", suffix=".log") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        server = ServerProcess(f"http://127.0.0.1:{port}", process.pid, process, Path(log_file.name))
        try:
            _wait_for_health(server)
            return run(args, server.base_url)
        finally:
            stop_server(server)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded default model)")
    parser.add_argument("--base-url", default=None, help="attach to a running server on 127.0.0.1 instead")
    parser.add_argument("--serve-args", default="", help="extra `pagedllm serve` flags, one shell-quoted string")
    parser.add_argument("--max-response-bytes", type=int, default=1 << 30)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--poll-interval-s", type=float, default=0.05)
    parser.add_argument("--max-health-latency-s", type=float, default=0.1)
    parser.add_argument("--fake-engine", action="store_true", help="serve the app over the tests' engine stand-in")
    args = parser.parse_args()
    if args.base_url is not None:
        if urlsplit(args.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"--base-url {args.base_url}: only a loopback server may be used")
        return run(args, args.base_url.rstrip("/"))

    if args.fake_engine:
        return run_fake_engine(args)

    from helpers.server import start_server

    serve_args = ["--max-response-bytes", str(args.max_response_bytes), *shlex.split(args.serve_args)]
    with start_server(args.model, *serve_args) as server:
        return run(args, server.base_url)


if __name__ == "__main__":
    sys.exit(main())
