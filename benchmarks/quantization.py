"""Weight quantization against the float model it came from: decode
tokens/s at batch 1 and 32, and the shipped tiny model's perplexity, same
run.

Speed: the ~100M random-weight Llama (hidden 768, 12 layers, GQA 12/4),
prompts of 32 tokens, 64 greedy tokens each with ignore_eos; every row runs
in its own subprocess (one engine: warm-up, then `--reps` timed runs,
median shown). Rows: `--dtype` (bfloat16 by default) without quantization,
with `--quantization int8`, and a GPTQ 4-bit checkpoint (group size 128,
written here by round to nearest: benchmarks/packed_checkpoints.py) read by
the gptq method. The ratio column is over float at the same batch size, and
"same tokens" counts the outputs equal to float's (random weights leave
many near-ties: a weight rounded may flip one).

Quality: perplexity of the shipped tiny model (pagedllm-tiny, float32
compute) on 32 windows of its held-out text, float against GPTQ and AWQ
4-bit checkpoints of it (group size 16: its intermediate size, 688, has no
larger power-of-two divisor; and GPTQ per channel).

    .venv/bin/python benchmarks/quantization.py [--dtype bfloat16] [--threads 2] [--reps 3] [--skip-speed]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH_SIZES = (1, 32)
SPEED_ROWS = ("float", "int8", "gptq-g128")  # label -> --quantization or a checkpoint (speed_rows)
QUALITY_ROWS = {"float": None, "gptq-g16": ("gptq", 16), "gptq-channel": ("gptq", -1), "awq-g16": ("awq", 16)}
NUM_WINDOWS = 32


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


def perplexity_row(args: argparse.Namespace) -> dict:
    """exp(mean NLL) over the held-out windows, from the engine's prompt logprobs."""
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_registry import tiny
    from pagedllm.training.tiny.evaluate import validation_windows

    torch.set_num_threads(args.threads)
    all_windows, bos_id = validation_windows(tiny.get_tokenizer_dir())
    windows = [w.tolist() for w in all_windows[:: len(all_windows) // NUM_WINDOWS][:NUM_WINDOWS]]
    llm = LLM(model=args.model_path, dtype="float32")
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.shutdown()
    nll, count = 0.0, 0
    for window, output in zip(windows, outputs, strict=True):
        for token, entry in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            if token != bos_id:
                nll, count = nll - entry[token].logprob, count + 1
    return {"perplexity": math.exp(nll / count)}


def child(extra: list[str]) -> dict:
    result = subprocess.run([sys.executable, __file__, *sys.argv[1:], *extra], check=True, capture_output=True,
                            text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def speed_table(args: argparse.Namespace, workdir: Path) -> None:
    from packed_checkpoints import write_packed_checkpoint

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir

    model_path = get_benchmark_100m_model_dir()
    gptq_path = write_packed_checkpoint(model_path, workdir / "gptq-g128", "gptq", 128)
    rows = {"float": [str(model_path)], "int8": [str(model_path), "--quantization", "int8"],
            "gptq-g128": [str(gptq_path)]}
    results = {(batch_size, label): child(["--batch-size", str(batch_size), "--model-path", *rows[label]])
               for batch_size in BATCH_SIZES for label in SPEED_ROWS}
    print(f"\n~100M Llama, 32-token prompts x {args.num_new_tokens} greedy tokens, {args.dtype}, "
          f"{args.threads} threads, median of {args.reps}")
    print(f"{'batch':>5} {'weights':<10}{'seconds':>9}{'tok/s':>9}{'vs float':>10}{'same tokens':>13}")
    for batch_size in BATCH_SIZES:
        float_row = results[batch_size, "float"]
        for label in SPEED_ROWS:
            row = results[batch_size, label]
            seconds = statistics.median(row["times"])
            same = sum(a == b for a, b in zip(row["tokens"], float_row["tokens"], strict=True))
            print(f"{batch_size:>5} {args.dtype if label == 'float' else label:<10}{seconds:>9.3f}"
                  f"{batch_size * args.num_new_tokens / seconds:>9.1f}"
                  f"{statistics.median(float_row['times']) / seconds:>9.2f}x{same:>9}/{batch_size}")


def quality_table(workdir: Path) -> None:
    from packed_checkpoints import write_packed_checkpoint

    from pagedllm.model_registry.tiny import get_tiny_model_dir

    source = get_tiny_model_dir()
    perplexities = {}
    for label, packing in QUALITY_ROWS.items():
        path = source if packing is None else write_packed_checkpoint(source, workdir / label, *packing)
        perplexities[label] = child(["--perplexity", "--model-path", str(path)])["perplexity"]
    print(f"\npagedllm-tiny, {NUM_WINDOWS} held-out windows of 256 tokens, float32 compute")
    print(f"{'weights':<14}{'perplexity':>11}{'vs float':>10}")
    for label, value in perplexities.items():
        print(f"{label:<14}{value:>11.3f}{100 * (value / perplexities['float'] - 1):>+9.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--skip-speed", action="store_true", help="only the perplexity table")
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)  # child modes
    parser.add_argument("--perplexity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.perplexity:
        print(json.dumps(perplexity_row(args)))
        return
    if args.batch_size is not None:
        print(json.dumps(run_row(args)))
        return
    with tempfile.TemporaryDirectory(prefix="pagedllm-quant-bench-") as workdir:
        if not args.skip_speed:
            speed_table(args, Path(workdir))
        quality_table(Path(workdir))


if __name__ == "__main__":
    main()
