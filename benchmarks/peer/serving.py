"""Serving, pagedllm's server against vLLM's CPU build's server, judged by
vLLM's own `bench serve` client (bench_client.py): random dataset, 128 input
/ 64 output tokens, greedy, ignore_eos, all requests at once under
--max-concurrency 1, 8 and 32 (the issue 17 table's levels).

One server at a time, on 127.0.0.1 and a free port, pinned to --cores (the
client shares those cores: it is part of the load either engine sees), the
same checkpoint folder, dtype and KV cache bytes. Each round starts one
server per engine (order alternating between rounds), times it from spawn to
its first completed /v1/completions request, runs every concurrency level
against it (each level with `concurrency` untimed warm-up requests), and
stops it by its process group id. The table shows medians over rounds.

    .venv/bin/python benchmarks/peer/serving.py [--model 7m|100m] [--dtype float32|bfloat16]
        [--concurrency 1,8,32] [--prompts-per-level N] [--rounds 2] [--input-len 128] [--output-len 64]
        [--cores 0-1] [--kv-cache-gib 1] [--python-vllm /work/peer-venv/bin/python] [--vllm-env KEY=VALUE ...]
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
    ENGINES,
    PEER_DIR,
    Placement,
    add_placement_args,
    engine_order,
    fmt,
    fmt_ratio,
    free_port,
    log,
    markdown_table,
    median,
    placement_from_args,
    run_json_child,
    speedup,
    stop_process_group,
)

SERVED_MODEL_NAME = "peer"
HOST = "127.0.0.1"


def server_command(engine: str, placement: Placement, model_path: str, dtype: str, port: int) -> list[str]:
    common_flags = ["--host", HOST, "--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_MODEL_NAME,
                    "--seed", "0"]
    if engine == "vllm":
        # KV cache bytes and cores come from the environment (Placement.env).
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


def start_server(engine: str, placement: Placement, model_path: str, dtype: str, log_path: Path,
                 timeout: float) -> tuple[subprocess.Popen, int, float]:
    """Spawn the server (its own session, so its workers can be stopped with
    it) and poll until the first completion: (process, port, seconds)."""
    port = free_port()
    cmd = server_command(engine, placement, model_path, dtype, port)
    with log_path.open("w") as log_file:
        start = time.perf_counter()
        process = subprocess.Popen(cmd, env=placement.env(engine), stdout=log_file, stderr=subprocess.STDOUT,
                                   preexec_fn=placement.pin, start_new_session=True)
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{engine} server exited (rc={process.returncode}); log: {log_path}\n"
                               + log_path.read_text()[-4000:])
        if first_completion(port):
            return process, port, time.perf_counter() - start
        time.sleep(0.2)
    stop_process_group(process)
    raise RuntimeError(f"{engine} server gave no completion within {timeout:.0f} s; log: {log_path}")


def client_command(args: argparse.Namespace, model_path: str, port: int, concurrency: int) -> list[str]:
    return [
        args.python_vllm, str(PEER_DIR / "bench_client.py"),
        "--backend", "vllm", "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions",
        "--model", model_path, "--tokenizer", model_path, "--served-model-name", SERVED_MODEL_NAME,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(prompts_for(args, concurrency)),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--num-warmups", str(concurrency),
        "--temperature", "0", "--seed", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50", "--disable-tqdm",
    ]


def prompts_for(args: argparse.Namespace, concurrency: int) -> int:
    """Enough requests that the level runs full for most of its time: at
    least 32, and 8 waves of `concurrency`."""
    return args.prompts_per_level or max(32, 8 * concurrency)


@dataclass
class ServingResults:
    """Per engine: start-to-first-completion seconds per round, and per
    concurrency level the client's summary per round."""

    startup_s: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENGINES})
    levels: dict[str, dict[int, list[dict]]] = field(default_factory=lambda: {e: {} for e in ENGINES})

    def metric(self, engine: str, concurrency: int, key: str) -> float:
        return median([run[key] for run in self.levels[engine].get(concurrency, []) if run.get(key) is not None])

    def failed(self, engine: str, concurrency: int) -> int:
        return sum(run.get("failed") or 0 for run in self.levels[engine].get(concurrency, []))


def results_table(results: ServingResults, concurrencies: list[int]) -> str:
    rows = []
    for concurrency in concurrencies:
        tok_s = {e: results.metric(e, concurrency, "output_throughput") for e in ENGINES}
        ttft = {e: results.metric(e, concurrency, "median_ttft_ms") for e in ENGINES}
        itl = {e: results.metric(e, concurrency, "median_itl_ms") for e in ENGINES}
        failed = {e: results.failed(e, concurrency) for e in ENGINES}
        rows.append([
            str(concurrency), fmt(tok_s["pagedllm"]), fmt(tok_s["vllm"]),
            fmt_ratio(speedup(tok_s["pagedllm"], tok_s["vllm"], higher_is_better=True)),
            fmt(ttft["pagedllm"]), fmt(ttft["vllm"]), fmt(itl["pagedllm"], 2), fmt(itl["vllm"], 2),
            fmt_ratio(speedup(itl["pagedllm"], itl["vllm"], higher_is_better=False)),
            f"{failed['pagedllm']}/{failed['vllm']}",
        ])
    startup = {e: median(results.startup_s[e]) for e in ENGINES}
    rows.append([
        "start to first completion (s)", fmt(startup["pagedllm"], 2), fmt(startup["vllm"], 2),
        fmt_ratio(speedup(startup["pagedllm"], startup["vllm"], higher_is_better=False)),
        "", "", "", "", "", "",
    ])
    return markdown_table(["concurrency", "pagedllm out tok/s", "vLLM out tok/s", "pagedllm/vLLM",
                           "pagedllm TTFT p50 ms", "vLLM TTFT p50 ms", "pagedllm ITL p50 ms", "vLLM ITL p50 ms",
                           "ITL vLLM/pagedllm", "failed (p/v)"], rows)


def run_round(rnd: int, args: argparse.Namespace, model_path: str, log_dir: Path, results: ServingResults) -> None:
    placement = placement_from_args(args)
    for engine in (e for e in engine_order(rnd) if e in args.engines):
        log_path = log_dir / f"{engine}-round{rnd}.log"
        process, port, startup_s = start_server(engine, placement, model_path, args.dtype, log_path,
                                                args.server_timeout)
        results.startup_s[engine].append(startup_s)
        log(f"round {rnd} {engine}: first completion {startup_s:.2f} s after spawn (port {port})")
        try:
            for concurrency in args.concurrency:
                summary = run_json_child(client_command(args, model_path, port, concurrency), placement.env("client"),
                                         placement, args.client_timeout, f"bench client against {engine}")
                results.levels[engine].setdefault(concurrency, []).append(summary)
                log(f"round {rnd} {engine} c={concurrency}: {summary['output_throughput']:.1f} out tok/s, "
                    f"TTFT p50 {summary['median_ttft_ms']:.1f} ms, ITL p50 {summary['median_itl_ms']:.2f} ms, "
                    f"{summary['completed']} done, {summary['failed']} failed")
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
    parser.add_argument("--engines", type=lambda s: s.split(","), default=list(ENGINES),
                        help="comma-separated subset of pagedllm,vllm (e.g. pagedllm alone for a before/after)")
    parser.add_argument("--input-len", type=int, default=128)
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
          f"{args.kv_cache_gib} GiB each; median of {args.rounds} rounds; ratios > 1 mean pagedllm is better.\n")
    print(results_table(results, args.concurrency))


if __name__ == "__main__":
    main()
