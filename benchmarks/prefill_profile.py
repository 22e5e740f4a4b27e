"""Where a prefill step's time goes, against this machine's peak: one fresh
prompt of each length (no prefix hits) prefilled in one step, per phase.

The phases are step_profile.py's (its timers; "other" is the step's time no
phase claims: residual adds, the embedding, Python glue), with the linear
layers' GEMMs split by weight shape. For the GEMMs the FLOPs are counted as
they run (2 x M x N x K per call); for attention they are causal attention's
4 x query heads x head size per (query, key) pair, L (L + 1) / 2 pairs per
layer. Each is shown as GFLOP/s and as a fraction of the peak measured in the
same run: the best size x size x size GEMM in the model's dtype at the same
thread count (benchmarks/roofline.py's), taken before and after the steps.

The table shows the median over `--reps` steps of each length (the lengths
interleaved, each rep a new random prompt). The model's 2,048 positions
would leave a 2,048-token prompt no room to generate, so the model loads
from a copy of its folder whose config allows more positions (the same
weights; rotary's table is per position, so the computed rows are the same).

    .venv/bin/python benchmarks/prefill_profile.py [--lengths 256,1024,2048] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import step_profile
import torch
from roofline import ModelShape, measure_peak_flops
from throughput import MODELS

ATTENTION = "attention (paged, torch_native)"
LM_HEAD = "LM head + logits"


def model_folder(model: str, max_len: int, scratch: Path) -> Path:
    """The benchmark model's folder, or a copy (links to its files) whose
    config allows `max_len + 1` positions."""
    from pagedllm.model_registry import tiny

    folder = Path(str(getattr(tiny, MODELS[model][0])()))
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config["max_position_embeddings"] > max_len:
        return folder
    for item in folder.iterdir():
        if item.name != "config.json":
            (scratch / item.name).symlink_to(item)
    config["max_position_embeddings"] = 2 * max_len
    (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return scratch


def run_steps(args: argparse.Namespace, model_path: Path) -> tuple[dict[int, list[dict[str, float]]], float]:
    """Per prompt length, each measured step's phase times (seconds), FLOPs
    (`flops:<phase>`) and "step"; and the best peak FLOP/s seen."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import model_runner

    peak = measure_peak_flops(getattr(torch, args.dtype))
    llm = LLM(model=str(model_path), dtype=args.dtype, max_num_seqs=8, enforce_eager=True,
              max_num_batched_tokens=max(args.lengths), max_model_len=max(args.lengths) + 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    steps: dict[int, list[dict[str, float]]] = {length: [] for length in args.lengths}
    recorded: list[dict[str, float]] = []
    original = model_runner.ModelRunner.execute_model

    def execute_model(self: Any, scheduler_output: Any) -> Any:
        step_profile._totals.clear()
        step_profile._flops.clear()
        start = step_profile._clock[0]()
        output = original(self, scheduler_output)
        step = {**step_profile._totals, "step": step_profile._clock[0]() - start,
                "tokens": scheduler_output.total_num_scheduled_tokens}
        recorded.append(step | {f"flops:{name}": flops for name, flops in step_profile._flops.items()})
        return output

    model_runner.ModelRunner.execute_model = execute_model  # type: ignore[method-assign]
    rng = random.Random(0)
    for rep in range(args.reps + 1):  # rep 0: warm-up, not kept
        for length in args.lengths:
            recorded.clear()
            prompt = [rng.randrange(8, 8192) for _ in range(length)]
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            if len(recorded) != 1 or recorded[0]["tokens"] != length:
                raise RuntimeError(f"expected one {length}-token prefill step, got {recorded}")
            if rep:
                steps[length].append(recorded[0])
    return steps, max(peak, measure_peak_flops(getattr(torch, args.dtype)))


def phase_rows(steps: list[dict[str, float]]) -> list[tuple[str, float, float]]:
    """(phase, median ms, median GEMM FLOPs) for every phase, GEMMs by shape
    first, then their sum, "other" and the whole step."""
    names = {key for step in steps for key in step} - {"step", "tokens"}
    timed = sorted(name for name in names if not name.startswith("flops:"))
    gemms = [name for name in timed if name.startswith("GEMM ")]
    rows = []
    for name in [*gemms, *[name for name in timed if name not in gemms]]:
        rows.append((name, statistics.median(s.get(name, 0.0) for s in steps) * 1e3,
                     statistics.median(s.get(f"flops:{name}", 0.0) for s in steps)))
    gemm_sum = [row for row in rows if row[0] in gemms]
    rows.insert(len(gemms), ("GEMMs (linear layers, all)", sum(r[1] for r in gemm_sum), sum(r[2] for r in gemm_sum)))
    step_ms = statistics.median(s["step"] for s in steps) * 1e3
    claimed = sum(row[1] for row in rows if row[0] != "GEMMs (linear layers, all)")
    rows += [("other", step_ms - claimed, 0.0), ("step", step_ms, 0.0)]
    return rows


def print_table(args: argparse.Namespace, shape: ModelShape, steps: dict[int, list[dict[str, float]]],
                peak: float) -> None:
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, {args.clock} time; one fresh prompt per step, "
          f"median of {args.reps} steps per length")
    print(f"peak: {peak / 1e9:.0f} GFLOP/s (best 2048^3 {args.dtype} GEMM, same threads, same run)")
    print(f"{'tokens':>6}  {'phase':<32}{'ms':>9}{'share':>8}{'GFLOP':>9}{'GFLOP/s':>9}{'of peak':>9}")
    for length, length_steps in steps.items():
        rows = phase_rows(length_steps)
        step_ms = rows[-1][1]
        attention_flops = shape.attention_flops(length * (length + 1) // 2)
        total_flops = sum(flops for name, _, flops in rows if name.startswith("GEMM ") or name == LM_HEAD)
        total_flops += attention_flops
        for name, ms, flops in rows:
            if name == ATTENTION:
                flops = attention_flops
            elif name == "step":
                flops = total_flops
            line = f"{length:>6}  {name:<32}{ms:>9.2f}{ms / step_ms:>8.1%}"
            if flops:
                rate = flops / (ms / 1e3)
                line += f"{flops / 1e9:>9.2f}{rate / 1e9:>9.0f}{rate / peak:>9.1%}"
            print(line)


def main() -> None:
    parser = step_profile.profile_parser(__doc__, reps=3)
    parser.add_argument("--lengths", type=lambda text: [int(n) for n in text.split(",")], default=[256, 1024, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        step_profile._clock[0] = time.thread_time
    step_profile.instrument(gemm_phase=step_profile.gemm_by_shape)
    scratch = Path(tempfile.mkdtemp(prefix="prefill-profile-"))
    try:
        model_path = model_folder(args.model, max(args.lengths), scratch)
        steps, peak = run_steps(args, model_path)
        print_table(args, ModelShape.from_folder(model_path), steps, peak)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
