"""Quantized checkpoint formats against the float model they were written
from, in one run: decode speed, quality, and llama.cpp on the same GGUF files.

1. Decode tokens/s at batch 1 and 32 on the ~100M random-weight Llama
   (hidden 768, 12 layers, GQA 12/4; 32-token prompts, `--num-new-tokens`
   greedy tokens, ignore_eos, `--dtype` compute), each format written from
   the same bf16 checkpoint: bf16 itself, `int8` (quantized at load), GPTQ
   and AWQ 4-bit g=128, compressed-tensors W8A16 and W8A8-INT8, GGUF Q8_0
   and Q4_K_M. Every row runs in its own subprocess (one engine: warm-up, then
   `--reps` timed runs, best shown: this host is shared and noisy).
2. Perplexity of the shipped tiny model under each format, written from its
   float16 checkpoint, against the float checkpoint itself, all computed in
   float32 over `--windows` validation windows of 256 tokens (prompt
   logprobs). The targets: within 1 % of float for 8-bit, 3 % for 4-bit.
   (GPTQ and AWQ use g=16 there: 688, the tiny model's intermediate size,
   has no larger power-of-two divisor.)
3. llama.cpp's `llama-bench` (tg`--num-new-tokens`, `--threads` threads) on
   the same Q8_0 and Q4_K_M files, when `--llama-bench` names the binary.

The writers are the tests' own (tests/helpers/): each format's packing,
round-to-nearest, no calibration but compressed-tensors' static input scales.

    .venv/bin/python benchmarks/quantization.py [--llama-bench PATH] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

BATCH_SIZES = (1, 32)
CALIBRATION_PROMPTS = [[1, 5, 9, 14, 22, 7], [3, 3, 8, 40, 2]]


def _gguf(preset: str) -> Callable[[Path, Path], tuple[str, dict]]:
    def write(source: Path, out: Path) -> tuple[str, dict]:
        from helpers.gguf_writer import write_gguf

        out.mkdir(parents=True, exist_ok=True)  # the first format written there may be this one
        return str(write_gguf(source, out / f"model.{preset}.gguf", preset)), {"tokenizer": str(source)}
    return write


def _compressed_tensors(scheme: str) -> Callable[[Path, Path], tuple[str, dict]]:
    def write(source: Path, out: Path) -> tuple[str, dict]:
        from helpers.compressed_tensors_writer import write_compressed_tensors

        quantized, _, _ = write_compressed_tensors(source, out, scheme, CALIBRATION_PROMPTS)
        return str(quantized), {}
    return write


def _gptq_awq(fmt: str, group_size: int) -> Callable[[Path, Path], tuple[str, dict]]:
    """Asymmetric 4-bit; g=16 where a layer's inputs are no multiple of
    `group_size` (the tiny model's intermediate size, 688)."""
    def write(source: Path, out: Path) -> tuple[str, dict]:
        from helpers.gptq_awq_writer import Case, write_gptq_awq

        config = json.loads((source / "config.json").read_text())
        fits = all(size % group_size == 0 for size in (config["hidden_size"], config["intermediate_size"]))
        case = Case(fmt, group_size=group_size if fits else 16, sym=False)
        return str(write_gptq_awq(source, out / f"{fmt}-g{case.group_size}", case)[0]), {}
    return write


def _float(source: Path, out: Path) -> tuple[str, dict]:
    return str(source), {}


def _int8(source: Path, out: Path) -> tuple[str, dict]:
    return str(source), {"quantization": "int8"}


# name -> (bits, writer: (float checkpoint, scratch folder) -> (model path, LLM keyword arguments))
FORMATS: dict[str, tuple[int, Callable[[Path, Path], tuple[str, dict]]]] = {
    "float": (16, _float),
    "int8": (8, _int8),
    "gptq-4bit-g128": (4, _gptq_awq("gptq", 128)),
    "awq-4bit-g128": (4, _gptq_awq("awq", 128)),
    "ct-w8a16": (8, _compressed_tensors("w8a16_channel")),
    "ct-w8a8-int8": (8, _compressed_tensors("w8a8_int8_dynamic")),
    "gguf-Q8_0": (8, _gguf("Q8_0")),
    "gguf-Q4_K_M": (4, _gguf("Q4_K_M")),
}


def decode_row(args: argparse.Namespace) -> dict:
    import torch
    from throughput import timed_generate

    from pagedllm import LLM

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(8, 8192) for _ in range(32)] for _ in range(args.batch_size)]
    llm = LLM(model=args.model_path, dtype=args.dtype, max_num_seqs=256, **json.loads(args.llm_kwargs))
    times, _ = timed_generate(llm, prompts, args.num_new_tokens, args.reps)
    llm.shutdown()
    return {"times": times}


def perplexity_row(args: argparse.Namespace) -> dict:
    import torch
    from helpers.validation import validation_sample, validation_score

    from pagedllm import LLM

    torch.set_num_threads(args.threads)
    windows, bos_id = validation_sample(args.windows)
    llm = LLM(model=args.model_path, dtype="float32", **json.loads(args.llm_kwargs))
    score = validation_score(llm, windows, bos_id)
    llm.shutdown()
    return {"perplexity": score.perplexity}


def child(args: argparse.Namespace, mode: str, model_path: str, kwargs: dict, batch_size: int = 0) -> dict:
    argv = [sys.executable, __file__, "--child", mode, "--model-path", model_path, "--llm-kwargs", json.dumps(kwargs),
            "--batch-size", str(batch_size), "--threads", str(args.threads), "--reps", str(args.reps),
            "--num-new-tokens", str(args.num_new_tokens), "--dtype", args.dtype, "--windows", str(args.windows)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def llama_bench(binary: str, gguf_file: str, args: argparse.Namespace) -> float:
    done = subprocess.run([binary, "-m", gguf_file, "-p", "0", "-n", str(args.num_new_tokens), "-t", str(args.threads),
                           "-r", str(args.reps), "-o", "json"], check=True, capture_output=True, text=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=32, help="validation windows for perplexity")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of the formats")
    parser.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary")
    parser.add_argument("--child", choices=["decode", "perplexity"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--llm-kwargs", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(decode_row(args) if args.child == "decode" else perplexity_row(args)))
        return

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir, get_default_model_dir

    names = args.formats.split(",")
    big, small = Path(get_benchmark_100m_model_dir()), Path(get_default_model_dir())
    with tempfile.TemporaryDirectory(prefix="pagedllm-quant-bench-") as scratch:
        written = {name: (FORMATS[name][1](big, Path(scratch) / "big"), FORMATS[name][1](small, Path(scratch) / "tiny"))
                   for name in names}
        speed: dict[tuple[str, int], float] = {}
        for _ in range(2):  # two interleaved passes over every row: the best of both
            for batch in BATCH_SIZES:
                for name in names:
                    best = min(child(args, "decode", *written[name][0], batch_size=batch)["times"])
                    speed[name, batch] = min(best, speed.get((name, batch), best))
        quality = {name: child(args, "perplexity", *written[name][1])["perplexity"] for name in names}
        llama = {name: llama_bench(args.llama_bench, written[name][0][0], args)
                 for name in names if args.llama_bench and name.startswith("gguf-")}
    print(f"\n~100M Llama decode, 32-token prompts x {args.num_new_tokens} tokens, {args.dtype}, {args.threads} "
          f"threads, best of 2 x {args.reps}; perplexity of pagedllm-tiny over {args.windows} windows, float32")
    print(f"{'format':<16}{'bits':>5}{'tok/s b=1':>11}{'vs float':>9}{'tok/s b=32':>12}{'vs float':>9}"
          f"{'llama.cpp b=1':>15}{'ppl':>9}{'vs float':>9}")
    for name in names:
        rates = [batch * args.num_new_tokens / speed[name, batch] for batch in BATCH_SIZES]
        floats = [batch * args.num_new_tokens / speed["float", batch] for batch in BATCH_SIZES] if "float" in names \
            else rates
        ppl_ratio = quality[name] / quality.get("float", quality[name])
        llama_rate = f"{llama[name]:.1f}" if name in llama else "-"
        print(f"{name:<16}{FORMATS[name][0]:>5}{rates[0]:>11.1f}{rates[0] / floats[0]:>8.2f}x{rates[1]:>12.1f}"
              f"{rates[1] / floats[1]:>8.2f}x{llama_rate:>15}{quality[name]:>9.3f}{ppl_ratio:>8.3f}x")


if __name__ == "__main__":
    main()
