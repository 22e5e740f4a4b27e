"""Tensor parallelism's cost: offline throughput at TP=1 and TP=2 (mp, ray), same run.

Workload: the ~100M random-weight Llama (`get_benchmark_100m_model_dir()`:
hidden 768, 12 layers, GQA 12/4, 8,192-token vocab, float32), 32 prompts of
64-256 tokens, 64 greedy tokens each with ignore_eos. Each row runs in its own
subprocess with a warm-up and several timed repetitions (medians shown):

- TP=1 `uni`: one rank with every core (the reference);
- TP=2 `mp`: two rank processes, the cores split between them, gloo;
- TP=2 `ray`: the same over Ray actors (a local Ray instance the executor
  starts; skipped when Ray is not installed).

Per-step communication is what rank 0's tensor-parallel group measured in its
collectives (2 all-reduces per layer and the logits' all-gather; the wall
time includes waiting for the slower rank), over the steps it ran. On one
host with two cores TP=2 cannot be faster than TP=1 with both cores: the
table shows what the split and the collectives cost.

    .venv/bin/python benchmarks/tensor_parallel.py [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROWS = {  # name -> (executor, tensor_parallel_size)
    "tp1_uni": ("uni", 1),
    "tp2_mp": ("mp", 2),
    "tp2_ray": ("ray", 2),
}


def make_prompts(num_prompts: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids below 8 are the tokenizer's special tokens.
    return [[rng.randrange(8, vocab_size) for _ in range(rng.randint(64, 256))] for _ in range(num_prompts)]


def run_row(row: str, args: argparse.Namespace) -> dict:
    """In the child process: one engine, its timings, tokens and collective stats."""
    import torch

    from pagedllm import LLM, SamplingParams

    executor, tp_size = ROWS[row]
    if tp_size == 1:
        torch.set_num_threads(args.threads)
    llm = LLM(
        model=args.model_path, dtype="float32", tensor_parallel_size=tp_size,
        distributed_executor_backend=executor, max_num_seqs=256, max_num_batched_tokens=4096,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in make_prompts(args.num_prompts, 8192)]
    model_executor = llm.engine_core.engine_core.model_executor  # type: ignore[attr-defined]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    before = model_executor.collective_rpc("collective_stats")[0]
    times, outputs = [], []
    for _ in range(args.reps):
        llm.reset_prefix_cache()  # every repetition starts cold
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    after = model_executor.collective_rpc("collective_stats")[0]
    llm.shutdown()
    stats = {key: after[key] - before[key] for key in after}
    return {"times": times, "tokens": [list(o.outputs[0].token_ids) for o in outputs], "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--threads", type=int, default=2, help="cores of the TP=1 row (TP=2 splits them)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model-path", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(args.row, args)))
        return

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir

    model_path = str(get_benchmark_100m_model_dir())
    # Ray binds 127.0.0.1 (not the machine's interface address) with this set.
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    results = {}
    for row, (executor, _) in ROWS.items():
        if executor == "ray" and importlib.util.find_spec("ray") is None:
            print(f"{row}: skipped (pip install 'pagedllm[ray]')")
            continue
        child = subprocess.run(
            [sys.executable, __file__, "--row", row, "--model-path", model_path, *sys.argv[1:]],
            check=True, capture_output=True, text=True, env=env,
        )
        results[row] = json.loads(child.stdout.strip().splitlines()[-1])
    print_table(results, args)


def print_table(results: dict[str, dict], args: argparse.Namespace) -> None:
    num_tokens = args.num_prompts * args.num_new_tokens
    base = statistics.median(results["tp1_uni"]["times"])
    print(f"\n~100M Llama, {args.num_prompts} prompts of 64-256 tokens x {args.num_new_tokens} greedy tokens, "
          f"float32, {args.threads} cores, median of {args.reps}")
    header = f"{'row':<10}{'seconds':>9}{'tok/s':>9}{'vs TP=1':>9}{'steps':>7}{'coll/step':>11}"
    print(header + f"{'comm ms/step':>14}{'comm share':>12}{'same tokens':>13}")
    reference = results["tp1_uni"]["tokens"]
    for row, result in results.items():
        seconds = statistics.median(result["times"])
        stats = result["stats"]
        steps = max(1, stats["num_steps"])
        comm_ms = 1000 * stats["collective_seconds"] / steps
        step_ms = 1000 * sum(result["times"]) / steps
        same = sum(a == b for a, b in zip(result["tokens"], reference, strict=True))
        print(f"{row:<10}{seconds:>9.3f}{num_tokens / seconds:>9.1f}{base / seconds:>9.2f}{steps // args.reps:>7}"
              f"{stats['num_collectives'] / steps:>11.1f}{comm_ms:>14.2f}{comm_ms / step_ms:>12.1%}"
              f"{f'{same}/{len(reference)}':>13}")


if __name__ == "__main__":
    main()
