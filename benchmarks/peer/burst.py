"""Prefill burst: how long streaming decoders stall when a few long prompts
arrive during steady decoding (issue 37 point 4).

D decoders (default 16) stream completions of random 64-token prompts
(max_tokens 256, greedy, ignore_eos). Once every decoder has received
--trigger-chunks chunks (16), B long prompts (default 4, 2,000 random token
ids each, max_tokens 1) are sent at once. Every chunk's arrival is stamped
with time.perf_counter as its line is read. The burst window runs from the
burst's send to one second after the last burst prompt completed; a gap
(between two consecutive chunks of one decoder) is in it when it overlaps it.

Per server and round: the decoders' worst gap in the window, their gap p50
and p99 in it, their gap p50 outside it (steady state), and the burst
prompts' TTFT (median and max); the table shows medians over rounds. The
servers are serving.py's (same start, placement and stop; --engines chooses
among pagedllm, vllm-2c and vllm). Prompts are token-id lists (`"prompt":
[ids]` in /v1/completions), ids drawn with a fixed seed from [1000,
vocab_size - 1000). The load runs in a child process of this script pinned
to --cores, as the bench client is (the client is part of the load every
server sees): plain threads, http.client, one connection per request. Each
server first gets one untimed load with other token ids (its warm-up, and
no prefix cache hits for the timed one).

    .venv/bin/python benchmarks/peer/burst.py [--model 100m] [--dtype bfloat16]
        [--engines pagedllm,vllm-2c,vllm] [--rounds 2] [--decoders 16] [--burst-prompts 4]
        [--burst-prompt-len 2000] [--cores 0-1] [--kv-cache-gib 1] [--python-vllm ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import astuple, dataclass, fields
from itertools import pairwise
from pathlib import Path

from peer_common import (
    PEERS,
    add_placement_args,
    engine_order,
    fmt,
    log,
    markdown_table,
    median,
    peers_arg,
    percentile,
    placement_from_args,
    print_result,
    run_json_child,
    stop_process_group,
)
from serving import HOST, SERVED_MODEL_NAME, start_server

ID_MARGIN = 1000  # ids from [ID_MARGIN, vocab_size - ID_MARGIN): no special tokens at either end
WINDOW_TAIL_S = 1.0  # the burst window's end: last burst prompt completed + this
WARMUP_SEED_OFFSET = 1000  # the warm-up load's seed: other ids than the timed load's


def vocab_size(model_path: str) -> int:
    return int(json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))["vocab_size"])


def make_prompts(seed: int, vocab: int, num_decoders: int, decoder_len: int, num_burst: int,
                 burst_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """(decoder prompts, burst prompts): random ids, the same for every server."""
    if vocab <= 2 * ID_MARGIN:
        raise ValueError(f"vocab_size={vocab}: expected more than {2 * ID_MARGIN} token ids")
    rng = random.Random(seed)

    def draw(length: int) -> list[int]:
        return [rng.randrange(ID_MARGIN, vocab - ID_MARGIN) for _ in range(length)]

    return [draw(decoder_len) for _ in range(num_decoders)], [draw(burst_len) for _ in range(num_burst)]


# ---- child: the load, standard library only --------------------------------


class StreamedRequest(threading.Thread):
    """One streaming /v1/completions request: connects at construction,
    sends when `go` is set, stamps every data chunk's arrival."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int, go: threading.Event, timeout: float,
                 on_chunk: threading.Event | None = None, chunks_to_signal: int = 0) -> None:
        super().__init__(daemon=True)
        self.body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True})
        self.go, self.on_chunk, self.chunks_to_signal = go, on_chunk, chunks_to_signal
        self.connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
        self.connection.connect()  # before `go`: the sends that follow it are all that is left
        self.sent_at = float("nan")
        self.done_at = float("nan")
        self.arrivals: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        self.go.wait()
        try:
            self.sent_at = time.perf_counter()
            self.connection.request("POST", "/v1/completions", self.body, {"Content-Type": "application/json"})
            response = self.connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
            for line in iter(response.readline, b""):
                now = time.perf_counter()  # first: the stamp is the line's arrival, not its parse
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                if b'"error"' in payload[:20]:
                    raise RuntimeError(payload[:500].decode(errors="replace"))
                self.arrivals.append(now)
                if len(self.arrivals) == self.chunks_to_signal and self.on_chunk is not None:
                    self.on_chunk.set()
            self.done_at = time.perf_counter()
        except Exception as error:  # reported with the results, never lost in a thread
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.connection.close()
            if self.on_chunk is not None:
                self.on_chunk.set()  # a decoder that failed early must not leave the burst waiting


def run_load(args: argparse.Namespace) -> dict:
    """Decoders first; the burst once each has `trigger_chunks` chunks."""
    decoder_prompts, burst_prompts = make_prompts(args.seed, args.vocab_size, args.decoders, args.decoder_prompt_len,
                                                  args.burst_prompts, args.burst_prompt_len)
    start_decoders, start_burst = threading.Event(), threading.Event()
    reached = [threading.Event() for _ in decoder_prompts]
    decoders = [StreamedRequest(args.load_port, prompt, args.decode_tokens, start_decoders, args.load_timeout,
                                on_chunk=event, chunks_to_signal=args.trigger_chunks)
                for prompt, event in zip(decoder_prompts, reached, strict=True)]
    burst = [StreamedRequest(args.load_port, prompt, 1, start_burst, args.load_timeout) for prompt in burst_prompts]
    for thread in decoders + burst:
        thread.start()
    start_decoders.set()
    deadline = time.monotonic() + args.load_timeout
    for event in reached:
        event.wait(max(deadline - time.monotonic(), 0.0))
    start_burst.set()
    for thread in decoders + burst:
        thread.join(max(deadline - time.monotonic(), 0.0))
    errors = [t.error or "timed out" for t in decoders + burst if t.error or t.is_alive()]
    return {
        "decoders": [t.arrivals for t in decoders],
        "burst": [{"sent": t.sent_at, "first": t.arrivals[0] if t.arrivals else None, "done": t.done_at}
                  for t in burst],
        "errors": errors,
    }


# ---- parent: metrics, rounds, table -----------------------------------------


@dataclass(frozen=True)
class BurstMetrics:
    """One load's figures, milliseconds except the window."""

    worst_gap_ms: float  # the decoders' longest gap in the burst window
    gap_p50_ms: float  # their gaps in the window
    gap_p99_ms: float
    steady_gap_p50_ms: float  # their gaps outside it
    burst_ttft_p50_ms: float
    burst_ttft_max_ms: float
    window_s: float  # burst sent to last burst prompt done, + WINDOW_TAIL_S
    failed: int

    HEADERS = ("worst gap ms", "gap p50 ms", "gap p99 ms", "steady gap p50 ms", "burst TTFT p50 ms",
               "burst TTFT max ms", "window s", "failed")


def burst_metrics(load: dict) -> BurstMetrics:
    sent = [b["sent"] for b in load["burst"]]
    ttfts = [(b["first"] - b["sent"]) * 1e3 for b in load["burst"] if b["first"] is not None]
    done = [b["done"] for b in load["burst"] if b["done"] == b["done"]]  # NaN != NaN: not completed
    window_start = min(sent) if sent else float("nan")
    window_end = (max(done) if done else window_start) + WINDOW_TAIL_S
    inside, outside = [], []
    for arrivals in load["decoders"]:
        for earlier, later in pairwise(arrivals):
            overlaps = later > window_start and earlier < window_end
            (inside if overlaps else outside).append((later - earlier) * 1e3)
    return BurstMetrics(
        worst_gap_ms=max(inside, default=float("nan")), gap_p50_ms=percentile(inside, 50),
        gap_p99_ms=percentile(inside, 99), steady_gap_p50_ms=percentile(outside, 50),
        burst_ttft_p50_ms=percentile(ttfts, 50), burst_ttft_max_ms=max(ttfts, default=float("nan")),
        window_s=window_end - window_start, failed=len(load["errors"]),
    )


def results_table(results: dict[str, list[BurstMetrics]], peers: list[str]) -> str:
    """One row per server, each column the median over its rounds (failed: the sum)."""
    rows = []
    for peer in peers:
        runs = results.get(peer, [])
        columns = list(zip(*(astuple(run) for run in runs), strict=True)) or [()] * len(fields(BurstMetrics))
        *figures, failed = columns
        rows.append([peer, *(fmt(median(values), 2 if i == 6 else 1) for i, values in enumerate(figures)),
                     str(sum(failed))])
    return markdown_table(["server", *BurstMetrics.HEADERS], rows)


def load_command(args: argparse.Namespace, port: int, vocab: int, seed: int) -> list[str]:
    return [sys.executable, __file__, "--load-port", str(port), "--seed", str(seed), "--vocab-size", str(vocab),
            "--decoders", str(args.decoders), "--decoder-prompt-len", str(args.decoder_prompt_len),
            "--decode-tokens", str(args.decode_tokens), "--trigger-chunks", str(args.trigger_chunks),
            "--burst-prompts", str(args.burst_prompts), "--burst-prompt-len", str(args.burst_prompt_len),
            "--load-timeout", str(args.load_timeout)]


def run_round(rnd: int, args: argparse.Namespace, model_path: str, log_dir: Path,
              results: dict[str, list[BurstMetrics]]) -> None:
    placement = placement_from_args(args)
    vocab = vocab_size(model_path)
    for peer in engine_order(rnd, args.engines):
        process, port, startup_s = start_server(peer, placement, model_path, args.dtype,
                                                log_dir / f"{peer}-burst-round{rnd}.log", args.server_timeout)
        log(f"round {rnd} {peer}: first completion {startup_s:.2f} s after spawn (port {port})")
        try:
            for seed, timed in ((args.seed + WARMUP_SEED_OFFSET, False), (args.seed, True)):
                load = run_json_child(load_command(args, port, vocab, seed), placement.env("client"), placement,
                                      args.load_timeout + 60.0, f"burst load against {peer}")
                metrics = burst_metrics(load)
                log(f"round {rnd} {peer} {'timed' if timed else 'warm-up'}: " + ", ".join(
                    f"{name} {fmt(value, 1)}" for name, value in zip(BurstMetrics.HEADERS[:-1], astuple(metrics),
                                                                        strict=False))
                    + f", failed {metrics.failed}" + "".join(f"\n  error: {error}" for error in load["errors"][:3]))
                if timed:
                    results.setdefault(peer, []).append(metrics)
        finally:
            stop_process_group(process)


def add_load_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--decoders", type=int, default=16, help="streaming decoders (default %(default)s)")
    add("--decoder-prompt-len", type=int, default=64, help="their prompt length (default %(default)s)")
    add("--decode-tokens", type=int, default=256, help="their max_tokens (default %(default)s)")
    add("--trigger-chunks", type=int, default=16,
        help="chunks every decoder has received before the burst is sent (default %(default)s)")
    add("--burst-prompts", type=int, default=4, help="long prompts sent at once (default %(default)s)")
    add("--burst-prompt-len", type=int, default=2000, help="their length in tokens (default %(default)s)")
    add("--seed", type=int, default=0, help="token ids' seed (default %(default)s)")
    add("--load-timeout", type=float, default=600.0, help="seconds one load may take (default %(default)s)")


def main() -> None:
    from checkpoints import DTYPES, MODELS, checkpoint_dir

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=MODELS, default="100m")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--engines", type=peers_arg, default=list(PEERS),
                        help="comma-separated servers, from pagedllm, vllm-2c and vllm (default all three)")
    parser.add_argument("--rounds", type=int, default=2, help="server starts per engine (default %(default)s)")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to the first completion")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    add_load_args(parser)
    add_placement_args(parser)
    parser.add_argument("--load-port", type=int, help=argparse.SUPPRESS)  # the child: run one load
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_port:
        print_result(run_load(args))
        return
    if min(args.decoders, args.decode_tokens, args.trigger_chunks, args.burst_prompts) < 1:
        parser.error("--decoders, --decode-tokens, --trigger-chunks and --burst-prompts must be >= 1")
    if args.trigger_chunks >= args.decode_tokens:
        parser.error(f"--trigger-chunks={args.trigger_chunks}: must be below --decode-tokens={args.decode_tokens}")
    model_path = str(checkpoint_dir(args.model, args.dtype))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="peer-burst-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"server logs: {log_dir}")
    results: dict[str, list[BurstMetrics]] = {}
    for rnd in range(args.rounds):
        run_round(rnd, args, model_path, log_dir, results)
    print(f"\nPrefill burst, {args.model} Llama {args.dtype}: {args.decoders} decoders ({args.decoder_prompt_len} "
          f"in / {args.decode_tokens} out, streaming), then {args.burst_prompts} prompts of {args.burst_prompt_len} "
          f"tokens at once after {args.trigger_chunks} chunks each; gaps between one decoder's chunks, window = "
          f"burst sent to last burst prompt done + {WINDOW_TAIL_S:.0f} s; cores {args.cores} for server and client; "
          f"vllm-2c: vLLM bound to cores {args.cores}, vllm: vLLM's default binding (auto); "
          f"median of {args.rounds} rounds.\n")
    print(results_table(results, args.engines))


if __name__ == "__main__":
    main()
