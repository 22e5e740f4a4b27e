"""Where one engine step's time goes, per phase: one prefill step and one
decode step of the throughput workload (benchmarks/throughput.py).

Each phase of the forward (the GEMMs, paged attention, RMSNorm, rotary, the
SwiGLU gate, the LM head, sampling, the host-side batch preparation) is
wrapped in a wall-clock timer; "other" is the step's time no phase claims
(residual adds, embedding, Python glue). Phases never nest, so the column
sums to the step. The table shows the median over `--reps` measured steps of
each kind; `--aten` adds torch.profiler's top operators for the same steps.

On a shared machine wall time at 2 threads mostly measures the other
processes (each small op's thread barrier waits for a descheduled thread):
`--threads 1 --clock cpu` times the main thread's CPU time instead, which
holds all the work at one thread and does not count time spent waiting.

    .venv/bin/python benchmarks/step_profile.py [--model 100m] [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from throughput import MODELS, make_prompts

_totals: dict[str, float] = defaultdict(float)
# FLOPs of the GEMMs (2 * M * N * K per call), charged to the phase that
# was timing when the GEMM ran: the linear layers' own, or the LM head's.
_flops: dict[str, float] = defaultdict(float)
_current: list[str] = []  # the phase being timed, if any
_clock: list[Callable[[], float]] = [time.perf_counter]


@contextmanager
def _phase(name: str) -> Iterator[None]:
    """Charge the wall time to `name`, unless an outer phase is already timing."""
    if _current:
        yield
        return
    _current.append(name)
    start = _clock[0]()
    try:
        yield
    finally:
        _totals[name] += _clock[0]() - start
        _current.pop()


def _wrap(owner: Any, attr: str, name: str | Callable[[Any], str]) -> None:
    """Time `owner.attr` as the phase `name`, or `name(self)` (a per-module name)."""
    original: Callable[..., Any] = getattr(owner, attr)

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        phase = name if isinstance(name, str) else name(self)
        with _phase(phase), torch.profiler.record_function(phase):
            return original(self, *args, **kwargs)

    setattr(owner, attr, timed)


def _count_gemm_flops(owner: Any) -> None:
    original: Callable[..., Any] = owner.apply_linear

    def counted(self: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if _current:
            _flops[_current[-1]] += 2 * (x.numel() // x.shape[-1]) * self.in_features * self.out_features
        return original(self, x, bias)

    owner.apply_linear = counted


def gemm_by_shape(layer: Any) -> str:
    """A linear layer's phase named by its weight's shape: 'GEMM 768->1280'."""
    return f"GEMM {layer.in_features}->{layer.out_features}"


def instrument(gemm_phase: str | Callable[[Any], str] = "GEMM (linear layers)") -> None:
    from pagedllm.attention_backends import torch_native
    from pagedllm.model_registry import input_batch
    from pagedllm.model_registry.layers import activation, attention, linear, logits_head, norm, rotary
    from pagedllm.worker import model_runner, sampler

    _wrap(model_runner.ModelRunner, "_prepare_inputs", "host: prepare inputs")
    _wrap(input_batch.InputBatch, "to_device", "host: metadata + attention plan")
    _wrap(torch_native.TorchNativeAttentionImpl, "forward", "attention (paged, torch_native)")
    _wrap(attention.Attention, "forward", "attention (paged, torch_native)")
    _wrap(linear.LinearBase, "__call__", gemm_phase)
    _count_gemm_flops(linear.LinearBase)
    _wrap(norm.RMSNorm, "__call__", "RMSNorm")
    _wrap(rotary.ApplyRotaryEmb, "__call__", "rotary")
    _wrap(activation.SiluAndMul, "__call__", "SiLU * mul")
    _wrap(logits_head.LogitsHead, "__call__", "LM head + logits")
    _wrap(sampler.Sampler, "__call__", "sampling")


def profile(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.model_registry import tiny
    from pagedllm.worker import model_runner

    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        _clock[0] = time.thread_time
    instrument()
    _, num_prompts, (min_len, max_len) = MODELS[args.model]
    model_path = str(getattr(tiny, MODELS[args.model][0])())
    prompts = make_prompts(num_prompts, min_len, max_len, 8192, seed=0)
    # Eager: a replayed decode graph (platforms/cpu/graph.py) runs none of the
    # Python the phase timers wrap (and their profiler ranges refuse capture).
    llm = LLM(model=model_path, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=4096, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    steps: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": []}
    original = model_runner.ModelRunner.execute_model
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.aten else None

    def execute_model(self: Any, scheduler_output: Any) -> Any:
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        kind = "decode" if num_tokens == num_reqs else "prefill"
        _totals.clear()
        _flops.clear()
        start = _clock[0]()
        output = original(self, scheduler_output)
        _totals["step"] = _clock[0]() - start
        if kind == "prefill" or num_reqs == len(prompts):
            steps[kind].append({**_totals, "tokens": num_tokens})
        return output

    model_runner.ModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    for kind in steps:
        steps[kind].clear()
    for _ in range(args.reps):
        llm.reset_prefix_cache()
        if profiler is not None:
            profiler.start()
        llm.generate(inputs, params, use_tqdm=False)
        if profiler is not None:
            profiler.stop()
    print_table(args, steps)
    if profiler is not None:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def print_table(args: argparse.Namespace, steps: dict[str, list[dict[str, float]]]) -> None:
    names = sorted({name for kind in steps.values() for step in kind for name in step} - {"step", "tokens"})
    batch = MODELS[args.model][1]
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, {args.clock} time, batch of {batch} requests; "
          f"median ms per step ({len(steps['prefill'])} prefill steps, {len(steps['decode'])} decode steps)")
    print(f"{'phase':<34}{'prefill ms':>12}{'share':>8}{'decode ms':>12}{'share':>8}")
    medians = {kind: {name: statistics.median(s.get(name, 0.0) for s in kind_steps) * 1e3 for name in
                      [*names, "step"]} for kind, kind_steps in steps.items()}
    for kind in medians:
        medians[kind]["other"] = medians[kind]["step"] - sum(medians[kind][name] for name in names)
    for name in [*names, "other", "step"]:
        row = f"{name:<34}"
        for kind in ("prefill", "decode"):
            value = medians[kind][name]
            row += f"{value:>12.2f}{value / medians[kind]['step']:>8.1%}"
        print(row)
    tokens = {kind: statistics.median(s["tokens"] for s in kind_steps) for kind, kind_steps in steps.items()}
    print(f"tokens per step (median): prefill {tokens['prefill']:.0f}, decode {tokens['decode']:.0f}")


def profile_parser(description: str | None, reps: int) -> argparse.ArgumentParser:
    """The flags this script and prefill_profile.py share."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=list(MODELS), default="100m")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the main thread's CPU time (use with --threads 1)")
    return parser


def main() -> None:
    parser = profile_parser(__doc__, reps=2)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--aten", action="store_true", help="also print torch.profiler's top operators")
    profile(parser.parse_args())


if __name__ == "__main__":
    main()
