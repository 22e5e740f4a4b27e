"""CPU decode attention: the paged-decode kernel vs gather + SDPA, same run.

Two measurements, both on the throughput workload (benchmarks/throughput.py;
default the ~100M Llama in bfloat16, 32 prompts of 64-256 tokens, 64 greedy
tokens each), one torch thread, CPU time of the main thread (on a shared
machine wall time mostly measures the other processes; `--threads 2` shows
wall time instead):

- per layer: every decode attention call of one generate runs both paths
  on the same inputs, alternating which goes first; the table shows the
  median per call and the ratio;
- whole generate: `--runs` pairs of subprocesses, kernel on
  (`PAGEDLLM_CPU_DECODE_KERNEL=1`) and off, interleaved A/B/A/B; each
  subprocess times `--reps` generates after a warm-up and reports the
  median, and the median CPU time of a decode step of the whole batch.
  The table shows the medians over runs and the ratios.

    .venv/bin/python benchmarks/paged_decode.py [--model 100m|small] [--dtype bfloat16|float32] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from throughput import MODELS, make_prompts


def _clock() -> float:
    """The main thread's CPU time at one thread; wall time at more (the
    other threads' work would not count)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _make_llm(args: argparse.Namespace) -> tuple[Any, list[dict[str, list[int]]], Any]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_registry import tiny

    _, num_prompts, (min_len, max_len) = MODELS[args.model]
    model_path = str(getattr(tiny, MODELS[args.model][0])())
    prompts = make_prompts(num_prompts, min_len, max_len, 8192, seed=0)
    # Eager: a replayed decode graph would not call the wrapped _attend_group.
    llm = LLM(model=model_path, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=4096, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    return llm, [{"prompt_token_ids": p} for p in prompts], params


def per_layer(args: argparse.Namespace) -> dict[str, float]:
    """Median CPU ms per decode attention call, kernel and gather + SDPA, same inputs."""
    from pagedllm.attention_backends import torch_native

    times: dict[str, list[float]] = {"kernel": [], "gather + SDPA": []}
    attend = torch_native.TorchNativeAttentionImpl._attend_group

    def timed_path(self: Any, name: str, *call: Any) -> torch.Tensor:
        group = call[3]
        saved = group.block_table
        if name == "gather + SDPA":
            group.block_table = None  # the group then takes the gather + SDPA path
        start = _clock()
        out = attend(self, *call)
        times[name].append(_clock() - start)
        group.block_table = saved
        return out

    def both(self: Any, *call: Any) -> torch.Tensor:
        if call[3].block_table is None:
            return attend(self, *call)
        order = list(times) if len(times["kernel"]) % 2 else list(times)[::-1]
        outs = {name: timed_path(self, name, *call) for name in order}
        return outs["kernel"]

    torch_native.TorchNativeAttentionImpl._attend_group = both  # type: ignore[method-assign]
    llm, inputs, params = _make_llm(args)
    llm.generate(inputs, params, use_tqdm=False)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def whole_generate(args: argparse.Namespace) -> dict[str, float]:
    """Median CPU seconds of one generate and CPU ms of one full-batch decode
    step (this process, kernel per the environment)."""
    from pagedllm.worker import model_runner

    llm, inputs, params = _make_llm(args)
    decode_steps: list[float] = []
    execute_model = model_runner.ModelRunner.execute_model

    def timed_step(self: Any, scheduler_output: Any) -> Any:
        start = _clock()
        output = execute_model(self, scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens) == len(inputs):
            decode_steps.append(_clock() - start)
        return output

    model_runner.ModelRunner.execute_model = timed_step  # type: ignore[method-assign]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up (and the kernel's build, if any)
    decode_steps.clear()
    seconds = []
    for _ in range(args.reps):
        llm.reset_prefix_cache()
        start = _clock()
        llm.generate(inputs, params, use_tqdm=False)
        seconds.append(_clock() - start)
    return {"seconds": statistics.median(seconds), "decode_ms": statistics.median(decode_steps) * 1e3}


def run_child(args: argparse.Namespace, kernel: bool) -> dict[str, float]:
    env = {**os.environ, "PAGEDLLM_CPU_DECODE_KERNEL": "1" if kernel else "0"}
    command = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype, "--threads",
               str(args.threads),
               "--reps", str(args.reps), "--num-new-tokens", str(args.num_new_tokens)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    child: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return child


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=list(MODELS), default="100m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--runs", type=int, default=2, help="A/B subprocess pairs for the whole-generate rows")
    parser.add_argument("--reps", type=int, default=3, help="timed generates per subprocess")
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; above 1 the table shows wall time")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(whole_generate(args)))
        return

    layer = per_layer(args)
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(args.runs):
        for kernel in (True, False) if i % 2 == 0 else (False, True):
            runs[kernel].append(run_child(args, kernel))
    clock = "CPU time" if args.threads == 1 else "wall time"
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, {clock}; batch of {MODELS[args.model][1]} requests, "
          f"{args.num_new_tokens} new tokens each")
    print(f"{'measurement':<40}{'kernel':>12}{'gather+SDPA':>14}{'ratio':>8}")
    print(f"{'decode attention, ms per layer call':<40}{layer['kernel']:>12.3f}{layer['gather + SDPA']:>14.3f}"
          f"{layer['kernel'] / layer['gather + SDPA']:>8.2f}")
    rows = (("decode_ms", "one decode step (whole batch), ms"), ("seconds", "one generate (prefill + decode), s"))
    for key, label in rows:
        on = statistics.median(run[key] for run in runs[True])
        off = statistics.median(run[key] for run in runs[False])
        print(f"{label:<40}{on:>12.2f}{off:>14.2f}{on / off:>8.2f}")


if __name__ == "__main__":
    main()
