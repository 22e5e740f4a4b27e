"""Where a single request's decode step goes: forward vs everything else,
synchronous vs async scheduling, same run.

One request (a 32-token prompt) decodes `--num-new-tokens` greedy tokens on
the shipped tiny model (or `--model`). In-process rows wrap the model
runner, so each output token's wall time splits into
- forward: the model's forward pass (ModelRunner._forward),
- runner other: the rest of ModelRunner.execute_model (input preparation,
  logits, sampling),
- engine other: what is left of the token's time (scheduling, update,
  detokenizing in LLM) -- with async scheduling it overlaps the next forward,
  so it can come out below zero ("hidden").
The engine-core-process rows (`multiprocess=True`, the server's path over ZMQ)
show only the wall time per token. Each row its own process, median of
`--reps` runs, in alternating order.

    .venv/bin/python benchmarks/decode_step.py [--reps 5] [--num-new-tokens 128] [--model tiny] [--threads 1]
        [--rows 0,2]   # only the sync rows: these also run with an older tree's python, for a before/after
    (row 4: synchronous and eager, no decode graphs: what the graphs take off a token)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (name, LLM keyword arguments, in the engine-core process); the sync rows
# pass nothing, so they also run on a tree from before async scheduling.
ROWS = [
    ("sync, in-process", {}, False),
    ("async, in-process", {"async_scheduling": True}, False),
    ("sync, engine-core process", {}, True),
    ("async, engine-core process", {"async_scheduling": True}, True),
    ("sync, in-process, eager (no decode graphs)", {"enforce_eager": True}, False),
]


def measure(row: int, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from pagedllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    _, kwargs, multiprocess = ROWS[row]
    llm = LLM(model=args.model, multiprocess=multiprocess, **kwargs)
    timers = {"forward": 0.0, "runner": 0.0}
    if not multiprocess:
        runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner  # type: ignore[attr-defined]
        _wrap(runner, "_forward", timers, "forward")
        _wrap(runner, "execute_model", timers, "runner")
    params = SamplingParams(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    timers.update(forward=0.0, runner=0.0)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    per_token = 1000 / args.num_new_tokens
    return {"total": elapsed * per_token, "forward": timers["forward"] * per_token,
            "runner": timers["runner"] * per_token}


def _wrap(obj: object, name: str, timers: dict[str, float], key: str) -> None:
    method = getattr(obj, name)

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter() - start

    setattr(obj, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="0,1,2,3,4", help="which rows to run (indexes into ROWS)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(row) for row in args.rows.split(",")]
    if args.child is not None:
        print(json.dumps(measure(args.child, args)))
        return
    results: dict[int, list[dict[str, float]]] = {row: [] for row in rows}
    # The engine-core process gets the same torch thread count as this side.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for rep in range(args.reps):
        for row in rows if rep % 2 == 0 else reversed(rows):
            command = [sys.executable, __file__, "--child", str(row), "--model", args.model,
                       "--num-new-tokens", str(args.num_new_tokens), "--threads", str(args.threads)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            results[row].append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nsingle-request decode, {args.model}, {args.num_new_tokens} tokens, {args.threads} torch thread(s), "
          f"median of {args.reps}\n")
    print("| row | ms/token | vs sync | forward ms | runner other ms | engine other ms |")
    print("|---|---|---|---|---|---|")
    base = {multiprocess: statistics.median(r["total"] for r in results[row])
            for row, (_, kwargs, multiprocess) in enumerate(ROWS) if not kwargs and row in rows}
    for row, (name, _, multiprocess) in enumerate(ROWS):
        if row not in rows:
            continue
        med = {key: statistics.median(r[key] for r in results[row]) for key in ("total", "forward", "runner")}
        split = "| - | - | - |" if multiprocess else (
            f"| {med['forward']:.2f} | {med['runner'] - med['forward']:.2f} | {med['total'] - med['runner']:.2f} |")
        ratio = f"{base[multiprocess] / med['total']:.2f}x" if multiprocess in base else "-"
        print(f"| {name} | {med['total']:.2f} | {ratio} {split}")


if __name__ == "__main__":
    main()
