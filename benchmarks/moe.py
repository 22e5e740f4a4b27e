"""A Qwen3-MoE-shaped expert layer on the CPU: the FusedMoE reference
(`forward_reference`, what every MoE step ran before) against the CPU
"fused_moe" kernel's paths (platforms/cpu/fused_moe.py), same run, same
weights, bfloat16.

The layer: hidden 1024, moe_intermediate 768, 32 experts, top-k 8 (each
expert 4.7 MB). --layers copies of it are used in turn, each call with
fresh random routing, so the experts stream from memory as they do in a
model's step rather than from the cache. Each cell is the fastest of --reps
calls. "GB/s" is the bytes of the experts the call actually reads (each
distinct selected expert's w13 and w2 once) over its time, and "of peak"
that as a fraction of the best of three peaks measured in the same run: a
large tensor copy (bytes read + written), a read-only pass (torch's amax)
and a dense bfloat16 GEMV through F.linear. A kernel that streams better
than those torch ops shows more than 100 %. Ratios > 1: the kernel path is faster than the reference.

Paths: "auto" is what the bound kernel runs (the C decode kernel up to
DECODE_MAX_TOKENS tokens, the grouped prepacked GEMMs above); the others are
each path forced, to show where the switch belongs ("torch_gather", the
capture-safe fallback without the C kernel, only at sizes it may take).

    .venv/bin/python benchmarks/moe.py [--tokens 1,32,512] [--top-k 8] [--threads 1] [--reps 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig, select_experts
from pagedllm.platforms.cpu import fused_moe as cpu_moe

HIDDEN, INTER, EXPERTS = 1024, 768, 32


def fastest(step: Callable[[int], object], reps: int) -> float:
    """The best time of `reps` calls, call i given i (to rotate inputs)."""
    step(0)
    best = float("inf")
    for rep in range(1, reps + 1):
        start = time.perf_counter()
        step(rep)
        best = min(best, time.perf_counter() - start)
    return best


def peak_bandwidth(reps: int) -> tuple[float, float, float]:
    """(copy, read, dense bf16 GEMV) GB/s on 256 MB buffers: a copy counts
    the bytes read and written, a read is a max over them (reads only)."""
    src = torch.empty(128 << 20, dtype=torch.bfloat16).fill_(1.0)
    dst = torch.empty_like(src)
    copy = fastest(lambda _: dst.copy_(src), reps)
    read = fastest(lambda _: src.view(torch.float32).amax(), reps)
    weight = torch.randn(16384, 8192).to(torch.bfloat16)
    x = torch.randn(1, 8192).to(torch.bfloat16)
    gemv = fastest(lambda _: F.linear(x, weight), reps)
    return 2 * src.nbytes / copy / 1e9, src.nbytes / read / 1e9, weight.nbytes / gemv / 1e9


def make_layer(top_k: int, seed: int) -> FusedMoE:
    layer = FusedMoE(RouterConfig(EXPERTS, top_k), HIDDEN, INTER)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.data = (torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5).to(torch.bfloat16)
    return layer


def bench_tokens(tokens: int, args: argparse.Namespace, layers: list[FusedMoE], kernels: list[cpu_moe.CpuFusedMoE],
                 peak: float, generator: torch.Generator) -> None:
    inputs = []
    for _ in range(args.reps + 1):
        topk_weights, topk_ids = select_experts(torch.randn(tokens, EXPERTS, generator=generator), layers[0].router)
        x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
        inputs.append((x, topk_weights, topk_ids))
    read = sum(ids.unique().numel() for _, _, ids in inputs) / len(inputs) * 3 * INTER * HIDDEN * 2

    def timed(run: Callable[[int, tuple[torch.Tensor, ...]], object]) -> float:
        return fastest(lambda rep: run(rep % args.layers, inputs[rep]), args.reps)

    t_ref = timed(lambda i, args_: layers[i].forward_reference(*args_))
    library = cpu_moe.load()
    paths: dict[str, Callable[[int, tuple[torch.Tensor, ...]], object]] = {
        "auto": lambda i, args_: kernels[i](*args_),
        "c_kernel": lambda i, args_: kernels[i].decode_kernel(library, *args_),
        "grouped_gemms": lambda i, args_: kernels[i].grouped_gemms(*args_),
    }
    if tokens * args.top_k * kernels[0].expert_bytes <= cpu_moe.GATHER_MAX_BYTES:
        paths["torch_gather"] = lambda i, args_: kernels[i].decode_gathered(*args_)
    for name, run in paths.items():
        t_kernel = timed(run)
        gbs = read / t_kernel / 1e9
        print(f"{tokens:>4} {name:>15} {t_ref * 1e3:>8.2f} {t_kernel * 1e3:>10.2f} {t_ref / t_kernel:>10.2f}x"
              f" {read / 1e6:>8.1f} {gbs:>6.1f} {gbs / peak:>7.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_moe.load() is None:
        raise SystemExit("the C MoE kernel is unavailable here (no C compiler, or PAGEDLLM_CPU_MOE_KERNEL=0)")
    copy_gbs, read_gbs, gemv_gbs = peak_bandwidth(args.reps)
    peak = max(copy_gbs, read_gbs, gemv_gbs)
    layers = [make_layer(args.top_k, seed) for seed in range(args.layers)]
    kernels = [cpu_moe.build(layer) for layer in layers]
    expert_bytes = 3 * INTER * HIDDEN * 2  # w13 and w2, bfloat16
    print(f"{EXPERTS} experts x {expert_bytes / 1e6:.1f} MB (hidden {HIDDEN}, intermediate {INTER}), top-{args.top_k}, "
          f"bfloat16, {args.layers} layers in turn, {args.threads} thread(s)")
    print(f"peak (the best): copy {copy_gbs:.1f} GB/s, read {read_gbs:.1f} GB/s, dense bf16 GEMV {gemv_gbs:.1f} GB/s")
    print(f"{'T':>4} {'path':>15} {'ref ms':>8} {'kernel ms':>10} {'ref/kernel':>11} {'MB read':>8} {'GB/s':>6}"
          f" {'of peak':>8}")
    generator = torch.Generator().manual_seed(1)
    for tokens in (int(t) for t in args.tokens.split(",")):
        bench_tokens(tokens, args, layers, kernels, peak, generator)


if __name__ == "__main__":
    main()
