"""Decode-sized bfloat16 GEMMs: the AMX kernel (platforms/cpu/amx_linear.py)
against oneDNN's prepacked GEMM (what the layers used before) and F.linear,
same run, same weights.

The weights are the ~100M Llama's 48 layer GEMMs (qkv 1280x768, o 768x768,
gate_up 4096x768, down 768x2048, 151 MB in bfloat16), run one after the
other as a decode step runs them, so they stream from memory (not one
cache-resident weight called in a loop). Each cell is the fastest of --reps
passes; GB/s is the weight bytes over that time. Ratios > 1: the kernel is
faster.

    .venv/bin/python benchmarks/amx_linear.py [--rows 1,8,32,64] [--threads 1,2] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu import amx_linear as cpu_amx_linear

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]  # (N, K) of one layer
NUM_LAYERS = 12


def run_amx(weights: list[torch.Tensor], packs: list, xs: dict[int, torch.Tensor]) -> None:
    for w, packed in zip(weights, packs, strict=True):
        cpu_amx_linear.linear(xs[w.shape[1]], packed, w.shape[0], None)


def run_onednn(weights: list[torch.Tensor], packs: list, xs: dict[int, torch.Tensor]) -> None:
    for w, packed in zip(weights, packs, strict=True):
        torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], packed, None, "none", [], "")


def run_f_linear(weights: list[torch.Tensor], packs: list, xs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        F.linear(xs[w.shape[1]], w)


def fastest(step: Callable[[], None], reps: int) -> float:
    step()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if cpu_amx_linear.load() is None:
        raise SystemExit("the AMX kernel is unavailable here (no AMX, no C compiler, or PAGEDLLM_CPU_AMX_LINEAR=0)")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator).to(torch.bfloat16) for _ in range(NUM_LAYERS) for n, k in SHAPES]
    amx = [cpu_amx_linear.pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    total_bytes = sum(w.numel() * 2 for w in weights)
    print(f"{len(weights)} GEMMs, {total_bytes / 1e6:.0f} MB of bfloat16 weights per pass")
    print(f"{'threads':>7} {'rows':>5} {'AMX ms':>8} {'GB/s':>6} {'oneDNN ms':>10} {'GB/s':>6} {'F.linear ms':>12}"
          f" {'oneDNN/AMX':>11} {'F.linear/AMX':>13}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in (768, 2048)}

            t_amx, t_dnn, t_f = (fastest(functools.partial(f, weights, packs, xs), args.reps)
                                 for f, packs in ((run_amx, amx), (run_onednn, onednn), (run_f_linear, weights)))
            gb_amx, gb_dnn = total_bytes / t_amx / 1e9, total_bytes / t_dnn / 1e9
            print(f"{threads:>7} {rows:>5} {t_amx * 1e3:>8.2f} {gb_amx:>6.1f} {t_dnn * 1e3:>10.2f} {gb_dnn:>6.1f}"
                  f" {t_f * 1e3:>12.2f} {t_dnn / t_amx:>10.2f}x {t_f / t_amx:>12.2f}x")


if __name__ == "__main__":
    main()
