"""The "lora" op on the CPU: reference vs the C kernel vs the grouped GEMMs.

    python benchmarks/lora_kernels.py [--dtype bfloat16] [--threads 2] [--reps 20]
        [--tokens 1,8,32,256,2048] [--adapters 1,4,16] [--rank 16]

One decoder layer of the ~100M Llama (hidden 768, intermediate 2048, 12
heads and 4 KV heads of 64): its four linear layers (stacked q/k/v, o,
stacked gate/up, down) with rank-`rank` adapter slots on every projection
(16 slots, as --max-loras 16). Rows are spread round-robin over the first
`adapters` slots, one row in 8 without an adapter ("16 + chunk": 32
decode rows so over 16 slots, then a prefill chunk of slot 1). Each row gives the
best time (of --reps) of the four layers' LoRA additions for `lora_reference`, the
grouped torch path, the C kernel alone, and the op as bound ("op": the C
kernel or, past cpu_lora.GEMM_MIN_ROWS rows of a slot, GEMMs for that
slot), and the base GEMMs' time (F.linear on
the same rows) as the yardstick: "x base" is the LoRA time over it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.model_registry.layers.lora import LoRABatchState, LoRASlots, lora_reference
from pagedllm.platforms.cpu import lora as cpu_lora

# (input, stacked outputs) of the ~100M Llama's linear layers
PROJECTIONS = {"qkv": (768, [768, 256, 256]), "o": (768, [768]), "gate_up": (768, [2048, 2048]),
               "down": (2048, [768])}
NUM_SLOTS = 16


def make_layer(num_in: int, outs: list[int], rank: int, dtype: torch.dtype) -> tuple[LoRASlots, torch.Tensor]:
    layer = LoRASlots(LoRABatchState(), num_slots=NUM_SLOTS, max_rank=rank, input_size=num_in, output_sizes=outs,
                      dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    layer.lora_a[1:] = (torch.randn(layer.lora_a[1:].shape, generator=generator) / num_in**0.5).to(dtype)
    start = 0
    for i, size in enumerate(outs):  # each sub-matrix's own block
        block = layer.lora_b[1:, start:start + size, i * rank:(i + 1) * rank]
        block.copy_(torch.randn(block.shape, generator=generator) * 0.01)
        start += size
    weight = (torch.randn(sum(outs), num_in, generator=generator) / num_in**0.5).to(dtype)
    return layer, weight


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


def make_slots(tokens: int, adapters: int, chunk: bool) -> torch.Tensor:
    """Round-robin over slots 1..adapters, one row in 8 without an adapter;
    `chunk`: only the first 32 rows so (decode rows), the rest one prefill
    chunk of slot 1."""
    slots = torch.arange(tokens, dtype=torch.int32) % adapters + 1
    slots[::8] = 0  # one row in 8 of the base model
    if chunk:
        slots[32:] = 1
    return slots


def run_case(layers: list[tuple[LoRASlots, torch.Tensor]], tokens: int, adapters: int, chunk: bool,
             dtype: torch.dtype, reps: int) -> dict[str, float]:
    slots = make_slots(tokens, adapters, chunk)
    xs = [torch.randn(tokens, layer.lora_a.shape[2]).to(dtype) for layer, _ in layers]
    ys = [torch.zeros(tokens, weight.shape[0], dtype=dtype) for _, weight in layers]
    kernels = [cpu_lora.CpuLoRAKernel(layer) for layer, _ in layers]
    library = cpu_lora.load()
    cases: dict[str, Callable[[], object]] = {
        "base": lambda: [F.linear(x, weight) for x, (_, weight) in zip(xs, layers, strict=True)],
        "reference": lambda: [lora_reference(y, x, layer.lora_a, layer.lora_b, slots)
                              for y, x, (layer, _) in zip(ys, xs, layers, strict=True)],
        "grouped": lambda: [cpu_lora.grouped_lora(y, x, layer.lora_a, layer.lora_b, slots)
                            for y, x, (layer, _) in zip(ys, xs, layers, strict=True)],
    }
    if library is not None:
        cases["C kernel"] = lambda: [kernel.c_kernel(library, y, x, slots)
                                     for kernel, y, x in zip(kernels, ys, xs, strict=True)]
    cases["op"] = lambda: [kernel(y, x, slots) for kernel, y, x in zip(kernels, ys, xs, strict=True)]
    return {name: best_ms(fn, reps) for name, fn in cases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", default="1,8,32,256,2048")
    parser.add_argument("--adapters", default="1,4,16")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layers = [make_layer(num_in, outs, args.rank, dtype) for num_in, outs in PROJECTIONS.values()]
    print(f"one ~100M-model layer's 4 projections, rank {args.rank}, {args.dtype}, {args.threads} threads; ms")
    columns = ("reference", "grouped", "C kernel", "op")
    print("| T | adapters | base GEMMs | " + " | ".join(f"{name} (x base)" for name in columns) + " |")
    print("|---:|---:|---:|" + "---:|" * len(columns))
    for tokens in (int(t) for t in args.tokens.split(",")):
        for adapters, chunk in [(int(a), False) for a in args.adapters.split(",")] + [(16, True)]:
            if adapters > max(tokens, 1) or (chunk and tokens <= 64):
                continue
            reps = args.reps if tokens < 1024 else max(3, args.reps // 4)
            times = run_case(layers, tokens, adapters, chunk, dtype, reps)
            base = times["base"]
            cells = [f"{times[name]:.3f} ({times[name] / base:.2f})" if name in times else "-" for name in columns]
            label = f"{adapters} + chunk" if chunk else str(adapters)
            print(f"| {tokens} | {label} | {base:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
