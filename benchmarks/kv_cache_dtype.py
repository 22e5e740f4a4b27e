"""fp8 KV cache storage against the model-dtype cache: blocks per memory
budget, and decode tokens/s at batch 1 and 32, same model, same prompts,
same run.

Workload: the ~100M random-weight Llama (hidden 768, 12 layers, GQA 12/4),
`--prompt-len`-token prompts, `--num-new-tokens` greedy tokens each with
ignore_eos, on the default attention backend. Every (batch, cache dtype) row
runs in its own subprocess (one engine: a warm-up, then `--reps` timed runs);
the rows run in turn, `--rounds` times over (interleaved, so machine load
falls on every row alike), and the table shows the median of all of a row's
runs. "vs auto" is the row's tok/s over the model-dtype cache's at the same
batch size; "blocks" is what `--kv-cache-memory-bytes` (256 MiB) holds.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--dtype bfloat16] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys

BATCH_SIZES = (1, 32)
CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2")
BUDGET_BYTES = 256 << 20


def run_row(args: argparse.Namespace) -> dict:
    import torch
    from throughput import timed_generate

    from pagedllm import LLM

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 8192) for _ in range(args.prompt_len)] for _ in range(args.batch_size)]
    llm = LLM(model=args.model_path, dtype=args.dtype, kv_cache_dtype=args.cache_dtype, max_num_seqs=256,
              kv_cache_memory_bytes=BUDGET_BYTES)
    num_blocks = llm.engine_core.ready.num_kv_blocks
    times, tokens = timed_generate(llm, prompts, args.num_new_tokens, args.reps)
    llm.shutdown()
    return {"times": times, "num_blocks": num_blocks, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--num-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--cache-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch_size is not None:
        print(json.dumps(run_row(args)))
        return

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir

    model_path = str(get_benchmark_100m_model_dir())
    results: dict[tuple[int, str], dict] = {}
    for _ in range(args.rounds):
        for batch_size in BATCH_SIZES:
            for cache_dtype in CACHE_DTYPES:
                child = subprocess.run(
                    [sys.executable, __file__, *sys.argv[1:], "--batch-size", str(batch_size),
                     "--cache-dtype", cache_dtype, "--model-path", model_path],
                    check=True, capture_output=True, text=True,
                )
                row = json.loads(child.stdout.strip().splitlines()[-1])
                print(f"batch {batch_size} {cache_dtype}: {row['times']}", file=sys.stderr, flush=True)
                previous = results.setdefault((batch_size, cache_dtype), {**row, "times": []})
                previous["times"] += row["times"]
    print(f"\n~100M Llama, {args.prompt_len}-token prompts x {args.num_new_tokens} greedy tokens, {args.dtype}, "
          f"{args.threads} threads, median of {args.rounds} rounds x {args.reps} runs, "
          f"KV budget {BUDGET_BYTES >> 20} MiB")
    print(f"{'batch':>5} {'kv cache':<10}{'blocks':>8}{'seconds':>9}{'tok/s':>9}{'vs auto':>9}{'same tokens':>13}")
    for batch_size in BATCH_SIZES:
        reference = results[batch_size, "auto"]
        auto_seconds = statistics.median(reference["times"])
        for cache_dtype in CACHE_DTYPES:
            row = results[batch_size, cache_dtype]
            seconds = statistics.median(row["times"])
            same = sum(a == b for a, b in zip(row["tokens"], reference["tokens"], strict=True))
            print(f"{batch_size:>5} {cache_dtype:<10}{row['num_blocks']:>8}{seconds:>9.3f}"
                  f"{batch_size * args.num_new_tokens / seconds:>9.1f}{auto_seconds / seconds:>8.2f}x"
                  f"{same:>9}/{batch_size}")


if __name__ == "__main__":
    main()
