"""Offline generation, pagedllm against vLLM's CPU build: same checkpoint
folder, same prompt token ids, greedy, ignore_eos, same cores and KV cache.

Workloads (issue 17's table):
  7m-float32     the 7M Llama, 64 prompts of 24-40 tokens x 64 new tokens, float32
  100m-float32   the ~100M Llama, 32 prompts of 64-256 tokens x 64 new tokens, float32
  100m-bfloat16  the same in bfloat16 (a bfloat16 checkpoint, both engines dtype=bfloat16)

Each rep starts one fresh child process per engine (pagedllm's `LLM` under
this python, vLLM's `LLM` under --python-vllm), engine order alternating
between reps; a child loads the model, runs one untimed warm-up generate,
then --runs timed ones (prefix cache reset before each). The table shows the
median over every timed run of every rep, and whether the two engines'
greedy token ids are identical (meaningful in float32; in bfloat16 the
engines' different summation orders may flip near-ties).

    .venv/bin/python benchmarks/peer/offline.py [--workloads 7m-float32,100m-float32,100m-bfloat16]
        [--engines pagedllm,vllm-2c] [--reps 4] [--runs 2] [--num-prompts N] [--num-new-tokens 64]
        [--cores 0-1] [--kv-cache-gib 1] [--python-vllm /work/peer-venv/bin/python] [--vllm-env KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from peer_common import (
    ENGINES,
    PEERS,
    add_placement_args,
    engine_of,
    engine_order,
    fmt,
    fmt_ratio,
    log,
    markdown_table,
    median,
    peers_arg,
    placement_from_args,
    print_result,
    run_json_child,
    speedup,
)

# name: (checkpoint model, dtype, default prompt count, prompt lengths)
WORKLOADS = {
    "7m-float32": ("7m", "float32", 64, (24, 40)),
    "100m-float32": ("100m", "float32", 32, (64, 256)),
    "100m-bfloat16": ("100m", "bfloat16", 32, (64, 256)),
}
FIRST_REGULAR_TOKEN_ID = 8  # ids below are the tokenizer's special tokens
VOCAB_SIZE = 8192


def make_prompts(num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_REGULAR_TOKEN_ID, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


# ---- child: one engine, one process -----------------------------------------


def build_llm(engine: str, model_path: str, dtype: str, kv_cache_gib: int):  # type: ignore[no-untyped-def]
    if engine_of(engine) == "vllm":
        from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

        # VLLM_CPU_KVCACHE_SPACE (set by the parent) sizes its KV cache.
        return LLM(model=model_path, dtype=dtype, seed=0), SamplingParams
    from pagedllm import LLM, SamplingParams

    return LLM(model=model_path, dtype=dtype, seed=0, kv_cache_memory_bytes=kv_cache_gib << 30), SamplingParams


def run_child(args: argparse.Namespace) -> dict:
    prompts = json.loads(Path(args.prompts_file).read_text())
    start = time.perf_counter()
    llm, sampling_params_cls = build_llm(args.child, args.model_path, args.dtype, args.kv_cache_gib)
    load_s = time.perf_counter() - start
    params = sampling_params_cls(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up (vLLM: also its torch.compile shapes)
    times, outputs = [], []
    for _ in range(args.runs):
        llm.reset_prefix_cache()  # every run starts cold: no hits from the last one
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    return {"times": times, "tokens": tokens, "load_s": load_s}


# ---- parent: interleave the engines, print the table ------------------------


@dataclass
class WorkloadResult:
    name: str
    num_prompts: int
    num_new_tokens: int
    times: dict[str, list[float]]
    load_s: dict[str, list[float]]
    tokens: dict[str, list[list[int]]]

    def seconds(self, engine: str) -> float:
        return median(self.times[engine])

    def tokens_per_s(self, engine: str) -> float:
        return self.num_prompts * self.num_new_tokens / self.seconds(engine)

    def num_identical(self, engine: str) -> int:
        """Prompts whose greedy token ids `engine` and pagedllm agree on."""
        return sum(a == b for a, b in zip(self.tokens[engine], self.tokens["pagedllm"], strict=True))


def run_workload(name: str, args: argparse.Namespace) -> WorkloadResult:
    from checkpoints import checkpoint_dir

    model, dtype, default_num_prompts, (min_len, max_len) = WORKLOADS[name]
    placement = placement_from_args(args)
    model_path = str(checkpoint_dir(model, dtype))
    prompts = make_prompts(args.num_prompts or default_num_prompts, min_len, max_len)
    result = WorkloadResult(name, len(prompts), args.num_new_tokens, {e: [] for e in args.engines},
                            {e: [] for e in args.engines}, {})
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="peer-prompts-") as prompts_file:
        json.dump(prompts, prompts_file)
        prompts_file.flush()
        for rep in range(args.reps):
            for engine in engine_order(rep, args.engines):
                cmd = [placement.python(engine), __file__, "--child", engine, "--model-path", model_path,
                       "--prompts-file", prompts_file.name, "--dtype", dtype, "--runs", str(args.runs),
                       "--num-new-tokens", str(args.num_new_tokens), "--kv-cache-gib", str(args.kv_cache_gib)]
                answer = run_json_child(cmd, placement.env(engine), placement, args.child_timeout, f"{engine} child")
                result.times[engine] += answer["times"]
                result.load_s[engine].append(answer["load_s"])
                result.tokens.setdefault(engine, answer["tokens"])
                log(f"{name} rep {rep} {engine}: " + ", ".join(f"{t:.3f}" for t in answer["times"])
                    + f" s (load {answer['load_s']:.1f} s)")
    return result


def results_table(results: list[WorkloadResult], engines: list[str]) -> str:
    """One row per (workload, engine); `pagedllm / this` > 1 when pagedllm is
    faster, `identical greedy` counts prompts whose tokens match pagedllm's."""
    rows = []
    for result in results:
        paged = "pagedllm" in result.times
        for engine in engines:
            rows.append([
                f"{result.name}, {result.num_prompts} prompts x {result.num_new_tokens}", engine,
                fmt(result.seconds(engine), 3), fmt(result.tokens_per_s(engine)),
                "-" if engine == "pagedllm" or not paged else fmt_ratio(
                    speedup(result.tokens_per_s("pagedllm"), result.tokens_per_s(engine), higher_is_better=True)),
                "-" if engine == "pagedllm" or not paged else f"{result.num_identical(engine)}/{result.num_prompts}",
            ])
    return markdown_table(["workload", "engine", "s", "out tok/s", "pagedllm / this", "identical greedy"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated, from: " + ", ".join(WORKLOADS))
    parser.add_argument("--engines", type=peers_arg, default=",".join(ENGINES),
                        help="comma-separated, from " + ",".join(PEERS) + " (default %(default)s)")
    parser.add_argument("--reps", type=int, default=4, help="fresh process pairs per workload (default %(default)s)")
    parser.add_argument("--runs", type=int, default=2, help="timed generate calls per process (default %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: the workload's (64 or 32)")
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--child-timeout", type=float, default=1800.0, help="seconds one child may take")
    add_placement_args(parser)
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print_result(run_child(args))
        return
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; expected some of {list(WORKLOADS)}")
    results = [run_workload(name, args) for name in names]
    print(f"\nOffline, greedy, ignore_eos; cores {args.cores} for every engine, KV cache {args.kv_cache_gib} GiB each; "
          f"median of {args.reps} processes per engine x {args.runs} runs; vllm-2c: vLLM bound to cores {args.cores}, "
          f"vllm: vLLM's default binding (auto); pagedllm / this > 1 means pagedllm is faster.\n")
    print(results_table(results, args.engines))
    print("\nmodel load + warm-up excluded; load seconds (median): " + "; ".join(
        f"{r.name}: " + ", ".join(f"{e} {median(r.load_s[e]):.1f}" for e in args.engines) for r in results))


if __name__ == "__main__":
    sys.exit(main())
