"""Grouped 8-bit and 4-bit weight GEMMs (platforms/cpu/grouped_linear.py)
against bfloat16 F.linear on the same shapes, same run.

Shapes: the ~100M Llama's layer GEMMs (qkv 1280x768, o 768x768, gate_up
4096x768, down 768x2048); each shape is held NUM_LAYERS times (as the
model's 12 layers hold it) and a cell is the time of one GEMM averaged over
a pass through all of them, so the weights stream from memory rather than
sitting in cache as one weight called in a loop would. Each cell is the
fastest of --reps passes, the variants interleaved. x is bfloat16; ratios
are bf16's time over the variant's (> 1: faster than bf16). Also printed,
for comparison: torch._weight_int8pack_mm (the int8 method's former
decode GEMM) on the W8 g=K weights, and torch._weight_int4pack_mm_for_cpu
on the W4 g=32 ones (not used by the kernel: its scales and zeros are
stored in x's dtype, which rounds the layout's float32 ones). The "i8a"
columns are the same weights on the int8-activation decode path
(PAGEDLLM_CPU_GROUPED_INT8_ACTIVATIONS=1; its rows of M <= 8 only).

    .venv/bin/python benchmarks/quant_gemm.py [--rows 1,8,32,256] [--threads 2] [--reps 10]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.platforms.cpu.grouped_linear import GroupedLinearKernel
from pagedllm.quantization.grouped_weight import GroupedWeight, pack_w4

SHAPES = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048)}
NUM_LAYERS = 12
VARIANTS = ("W8 g=32", "W8 g=K", "W4 g=32", "W4 g=128")
INT8_ACTIVATIONS = tuple(f"{variant} i8a" for variant in VARIANTS)


def grouped_weight(variant: str, weight: torch.Tensor) -> GroupedWeight:
    """`weight` [N, K] quantized (round to nearest) into the variant's layout."""
    bits, group_text = variant[1], variant.split("g=")[1].split()[0]
    num_out, num_in = weight.shape
    group = num_in if group_text == "K" else int(group_text)
    grouped = weight.float().view(num_out, num_in // group, group)
    if bits == "8":
        scales = grouped.abs().amax(-1).clamp(min=1e-12) / 127
        codes = torch.round(grouped / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return GroupedWeight(8, group, codes.view(num_out, num_in), scales, None)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return GroupedWeight(4, group, pack_w4(codes.view(num_out, num_in)), scales, low)


def best_time(run: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def int4pack(weight: GroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 packing of a W4 weight: w = (q - 8) * scale + zero,
    scales and zeros [K // g, N, 2] in x's dtype (here bfloat16: they round)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(weight.unpacked_codes().to(torch.int32), 1)
    assert weight.offsets is not None
    zeros = weight.offsets + 8 * weight.scales
    return packed, torch.stack([weight.scales.t(), zeros.t()], dim=-1).contiguous().to(torch.bfloat16)


def variant_runs(x: torch.Tensor, weights: list[torch.Tensor], kernels: dict[str, list[GroupedLinearKernel]],
                 int8: list[GroupedWeight], int4: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> dict[str, Callable[[], object]]:
    """One pass through the layers' GEMMs per variant."""
    int8_scales = [w.scales.view(-1).to(torch.bfloat16) for w in int8]
    runs: dict[str, Callable[[], object]] = {"bf16": lambda: [F.linear(x, w) for w in weights]}
    for variant, layer_kernels in kernels.items():
        runs[variant] = functools.partial(lambda ks: [k(x) for k in ks], layer_kernels)
    runs["int8pack_mm"] = lambda: [torch._weight_int8pack_mm(x, w.codes, s)
                                   for w, s in zip(int8, int8_scales, strict=True)]
    runs["int4pack_mm"] = lambda: [torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)
                                   for packed, scales_zeros in int4]
    return runs


def time_shape(num_out: int, num_in: int, rows: list[int], reps: int) -> dict[tuple[str, int], float]:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(num_out, num_in, generator=generator) * 0.02).to(torch.bfloat16)
               for _ in range(NUM_LAYERS)]
    kernels = {variant: [GroupedLinearKernel(grouped_weight(variant, w)) for w in weights] for variant in VARIANTS}
    for variant, name in zip(VARIANTS, INT8_ACTIVATIONS, strict=True):
        kernels[name] = [GroupedLinearKernel(kernel.packed) for kernel in kernels[variant]]
        for kernel in kernels[name]:
            kernel.int8_activations = True
    int8 = [grouped_weight("W8 g=K", w) for w in weights]
    int4 = [int4pack(kernels["W4 g=32"][i].weight) for i in range(NUM_LAYERS)]
    times: dict[tuple[str, int], float] = {}
    for m in rows:
        x = torch.randn(m, num_in, generator=generator).to(torch.bfloat16)
        runs = variant_runs(x, weights, kernels, int8, int4)
        for run in runs.values():
            run()  # warm-up: builds, oneDNN's primitive caches
        for _ in range(reps):  # interleaved: a slow moment of the machine hits every variant
            for name, run in runs.items():
                elapsed = best_time(run, 1) / NUM_LAYERS
                times[(name, m)] = min(times.get((name, m), float("inf")), elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rows", default="1,8,32,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    names = ("bf16", *VARIANTS, *INT8_ACTIVATIONS, "int8pack_mm", "int4pack_mm")
    print(f"threads={args.threads}; us per GEMM (ratio: bf16 time / variant time)")
    print(f"{'shape':>16} {'M':>4} " + " ".join(f"{name:>17}" for name in names))
    for label, (num_out, num_in) in SHAPES.items():
        times = time_shape(num_out, num_in, rows, args.reps)
        for m in rows:
            base = times[("bf16", m)]
            cells = [f"{times[(name, m)] * 1e6:9.1f} ({base / times[(name, m)]:4.2f}x)" for name in names]
            print(f"{label + ' ' + str(num_out) + 'x' + str(num_in):>16} {m:>4} " + " ".join(cells))


if __name__ == "__main__":
    main()
