"""Serving, pagedllm's server against vLLM's CPU build's server, judged by
vLLM's own `bench serve` client (bench_client.py): random dataset, 256 input
/ 64 output tokens, greedy, ignore_eos, all requests at once under
--max-concurrency 1, 8 and 32 (issue 37's table), percentiles 50 and 99.

Three servers per round (--engines): pagedllm; `vllm-2c`, vLLM with its
OpenMP threads bound to every core of --cores; and `vllm`, vLLM at its own
default thread binding ("auto": on 2 cores, one for its scheduler process and
one for the forward pass). One server at a time, on 127.0.0.1 and a free port,
pinned to --cores (the client shares those cores: it is part of the load
every server sees), the same checkpoint folder, dtype and KV cache bytes.
Each round starts one server per name (order rotating between rounds), times
it from spawn to its first completed /v1/completions request, runs every
concurrency level against it (each level with `concurrency` untimed warm-up
requests), and stops it by its process group id. The table shows medians
over rounds.

    .venv/bin/python benchmarks/peer/serving.py [--model 7m|100m] [--dtype float32|bfloat16]
        [--engines pagedllm,vllm-2c,vllm] [--concurrency 1,8,32] [--prompts-per-level N] [--rounds 2]
        [--input-len 256] [--output-len 64] [--cores 0-1] [--kv-cache-gib 1]
        [--python-vllm /work/peer-venv/bin/python] [--vllm-env KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from peer_common import (
    PEER_DIR,
    PEERS,
    Placement,
    add_placement_args,
    engine_of,
    engine_order,
    fmt,
    fmt_ratio,
    free_port,
    log,
    markdown_table,
    median,
    peers_arg,
    placement_from_args,
    run_json_child,
    speedup,
    stop_process_group,
)

SERVED_MODEL_NAME = "peer"
HOST = "127.0.0.1"


def server_command(peer: str, placement: Placement, model_path: str, dtype: str, port: int) -> list[str]:
    common_flags = ["--host", HOST, "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_MODEL_NAME,
                    "--seed", "0"]
    if engine_of(peer) == "vllm":
        # KV cache bytes and the thread binding come from the environment (Placement.env).
        return [placement.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                *common_flags]
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_path, *common_flags,
            "--kv-cache-memory-bytes", str(placement.kv_cache_bytes)]


def first_completion(port: int, timeout: float = 5.0) -> bool:
    """One tiny completion; True when the server answered it."""
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 1, "temperature": 0.0})
    request = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status == 200 and bool(json.loads(response.read())["choices"])
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
        return False


def start_server(peer: str, placement: Placement, model_path: str, dtype: str, log_path: Path,
                 timeout: float) -> tuple[subprocess.Popen, int, float]:
    """Spawn the server (its own session, so its workers can be stopped with
    it) and poll until the first completion: (process, port, seconds)."""
    port = free_port()
    cmd = server_command(peer, placement, model_path, dtype, port)
    with log_path.open("w") as log_file:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, env=placement.env(peer), stdout=log_file, stderr=subprocess.STDOUT,
                                   preexec_fn=placement.pin, start_new_session=True)
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{peer} server exited (rc={process.returncode}); log: {log_path}\n"
                               + log_path.read_text()[-4000:])
        if first_completion(port):
            return process, port, time.perf_counter() - start
        time.sleep(0.2)
    stop_process_group(process)
    raise RuntimeError(f"{peer} server gave no completion within {timeout:.0f} s; log: {log_path}")


def client_command(args: argparse.Namespace, model_path: str, port: int, concurrency: int) -> list[str]:
    return [
        args.python_vllm, str(PEER_DIR / "bench_client.py"),
        "--backend", "vllm", "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions",
        "--model", model_path, "--tokenizer", model_path, "--served-model-name", SERVED_MODEL_NAME,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(prompts_for(args, concurrency)),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--num-warmups", str(concurrency),
        "--temperature", "0", "--seed", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
    ]


def prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    """Enough requests that the level runs full for most of its time: at
    least 32, and 8 waves of `concurrency`."""
    return args.prompts_per_level or max(32, 8 * concurrency)


@dataclass
class ServingResults:
    """Per server: start-to-first-completion seconds per round, and per
    concurrency level the client's summary per round."""

    startup_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PEERS})
    levels: dict[str, dict[int, list[dict]]] = field(default_factory=lambda: {p: {} for p in PEERS})

    def metric(self, peer: str, concurrency: int, key: str) -> float:
        return median([run[key] for run in self.levels[peer].get(concurrency, []) if run.get(key) is not None])

    def failed(self, peer: str, concurrency: int) -> int:
        return sum(run.get("failed") or 0 for run in self.levels[peer].get(concurrency, []))


def tail_ratio(p99: float, p50: float) -> str:
    """ITL p99 over p50; a server that sends several chunks at once has a
    p50 near zero and a large ratio (TPOT p50 then says its pace)."""
    return "n/a" if not (p99 == p99 and p50 > 0) else f"{p99 / p50:.1f}"  # NaN != NaN


def results_table(results: ServingResults, concurrencies: list[int], peers: list[str]) -> str:
    """One row per (concurrency, server); `pagedllm / this` is pagedllm's out
    tok/s over this server's, > 1 when pagedllm serves more."""
    rows = []
    for concurrency in concurrencies:
        paged_tok_s = results.metric("pagedllm", concurrency, "output_throughput")
        for peer in peers:
            tok_s = results.metric(peer, concurrency, "output_throughput")
            itl_p50 = results.metric(peer, concurrency, "p50_itl_ms")
            itl_p99 = results.metric(peer, concurrency, "p99_itl_ms")
            rows.append([
                str(concurrency), peer, fmt(tok_s),
                "-" if peer == "pagedllm" else fmt_ratio(speedup(paged_tok_s, tok_s, higher_is_better=True)),
                fmt(results.metric(peer, concurrency, "p50_ttft_ms")), fmt(itl_p50, 2), fmt(itl_p99, 2),
                tail_ratio(itl_p99, itl_p50), fmt(results.metric(peer, concurrency, "p50_tpot_ms"), 2),
                str(results.failed(peer, concurrency)),
            ])
    return markdown_table(["concurrency", "server", "out tok/s", "pagedllm / this", "TTFT p50 ms", "ITL p50 ms",
                           "ITL p99 ms", "ITL p99/p50", "TPOT p50 ms", "failed"], rows)


def startup_table(results: ServingResults, peers: list[str]) -> str:
    """Start to first completion per server; `pagedllm / this` > 1 when pagedllm is up sooner."""
    startup = {peer: median(results.startup_s[peer]) for peer in peers}
    paged = median(results.startup_s["pagedllm"])
    rows = [[peer, fmt(startup[peer], 2),
             "-" if peer == "pagedllm" else fmt_ratio(speedup(paged, startup[peer], higher_is_better=False))]
            for peer in peers]
    return markdown_table(["server", "start to first completion s", "pagedllm / this"], rows)


def run_round(rnd: int, args: argparse.Namespace, model_path: str, log_dir: Path, results: ServingResults) -> None:
    placement = placement_from_args(args)
    for peer in engine_order(rnd, args.engines):
        log_path = log_dir / f"{peer}-round{rnd}.log"
        process, port, startup_s = start_server(peer, placement, model_path, args.dtype, log_path,
                                                args.server_timeout)
        results.startup_s[peer].append(startup_s)
        log(f"round {rnd} {peer}: first completion {startup_s:.2f} s after spawn (port {port})")
        try:
            for concurrency in args.concurrency:
                summary = run_json_child(client_command(args, model_path, port, concurrency), placement.env("client"),
                                         placement, args.client_timeout, f"bench client against {peer}")
                results.levels[peer].setdefault(concurrency, []).append(summary)
                log(f"round {rnd} {peer} c={concurrency}: {summary['output_throughput']:.1f} out tok/s, "
                    f"TTFT p50 {summary['p50_ttft_ms']:.1f} ms, ITL p50 {summary['p50_itl_ms']:.2f} ms, "
                    f"p99 {summary['p99_itl_ms']:.2f} ms, {summary['completed']} done, {summary['failed']} failed")
        finally:
            stop_process_group(process)


def main() -> None:
    from checkpoints import DTYPES, MODELS, checkpoint_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=MODELS, default="7m")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32],
                        help="comma-separated --max-concurrency levels (default 1,8,32)")
    parser.add_argument("--prompts-per-level", type=int, default=None, help="default: max(32, 8 x concurrency)")
    parser.add_argument("--rounds", type=int, default=2, help="server starts per engine (default %(default)s)")
    parser.add_argument("--engines", type=peers_arg, default=list(PEERS),
                        help="comma-separated servers, from pagedllm (this checkout), vllm-2c (vLLM bound to "
                             "every core) and vllm (vLLM's default binding); default all three; pagedllm alone "
                             "for a before/after")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to the first completion")
    parser.add_argument("--client-timeout", type=float, default=1800.0, help="seconds one level may take")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    add_placement_args(parser)
    args = parser.parse_args()
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency={args.concurrency}: levels must be >= 1")
    model_path = str(checkpoint_dir(args.model, args.dtype))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-serving-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"server logs: {log_dir}")
    results = ServingResults()
    for rnd in range(args.rounds):
        run_round(rnd, args, model_path, log_dir, results)
    print(f"\nServing, {args.model} Llama {args.dtype}, vLLM's bench serve client, random {args.input_len} in / "
          f"{args.output_len} out, greedy, ignore_eos; cores {args.cores} for server and client, KV cache "
          f"{args.kv_cache_gib} GiB each; median of {args.rounds} rounds; vllm-2c: vLLM bound to cores {args.cores}, "
          f"vllm: vLLM's default binding (auto); ratios > 1 mean pagedllm is better.\n")
    print(results_table(results, args.concurrency, args.engines))
    print()
    print(startup_table(results, args.engines))


if __name__ == "__main__":
    main()
