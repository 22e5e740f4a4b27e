"""int8 weight-only against the float model it was quantized from: decode
tokens/s at batch 1 and 32, same model, same prompts, same run.

Workload: the ~100M random-weight Llama (hidden 768, 12 layers, GQA 12/4),
prompts of 32 tokens, 64 greedy tokens each with ignore_eos; every row runs
in its own subprocess (one engine: warm-up, then `--reps` timed runs,
median shown). Rows: `--dtype` (bfloat16 by default) without quantization,
then with `--quantization int8`; the ratio column is int8 over float at the
same batch size, and "same tokens" counts the int8 outputs equal to float's
(random weights leave many near-ties: a weight rounded may flip one).

    .venv/bin/python benchmarks/quantization.py [--dtype bfloat16] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

BATCH_SIZES = (1, 32)
METHODS = (None, "int8")


def run_row(args: argparse.Namespace) -> dict:
    import torch
    from throughput import timed_generate

    from pagedllm import LLM

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 8192) for _ in range(32)] for _ in range(args.batch_size)]
    llm = LLM(model=args.model_path, dtype=args.dtype, quantization=args.quantization, max_num_seqs=256)
    times, tokens = timed_generate(llm, prompts, args.num_new_tokens, args.reps)
    llm.shutdown()
    return {"times": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch_size is not None:
        print(json.dumps(run_row(args)))
        return

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir

    model_path = str(get_benchmark_100m_model_dir())
    results = {}
    for batch_size in BATCH_SIZES:
        for method in METHODS:
            extra = [] if method is None else ["--quantization", method]
            child = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--batch-size", str(batch_size), "--model-path", model_path,
                 *extra], check=True, capture_output=True, text=True,
            )
            results[batch_size, method] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"\n~100M Llama, 32-token prompts x {args.num_new_tokens} greedy tokens, {args.dtype}, "
          f"{args.threads} threads, median of {args.reps}")
    print(f"{'batch':>5} {'weights':<10}{'seconds':>9}{'tok/s':>9}{'vs float':>10}{'same tokens':>13}")
    for batch_size in BATCH_SIZES:
        float_seconds = statistics.median(results[batch_size, None]["times"])
        for method in METHODS:
            row = results[batch_size, method]
            seconds = statistics.median(row["times"])
            same = sum(a == b for a, b in zip(row["tokens"], results[batch_size, None]["tokens"], strict=True))
            print(f"{batch_size:>5} {method or args.dtype:<10}{seconds:>9.3f}"
                  f"{batch_size * args.num_new_tokens / seconds:>9.1f}{float_seconds / seconds:>9.2f}x"
                  f"{same:>9}/{batch_size}")


if __name__ == "__main__":
    main()
