"""The MoE experts on CUDA: the Triton fused-MoE kernel vs the layer's torch reference.

    python benchmarks/moe_kernels.py [--dtype bfloat16] [--json FILE]
    python benchmarks/moe_kernels.py --cpu-dry-run   # plumbing only, via TRITON_INTERPRET=1

Qwen1.5-MoE-A2.7B-like experts (60 experts, top-4, hidden 2048,
intermediate 1408) and Mixtral-8x7B-like ones (8 experts, top-2, hidden
4096, intermediate 14336 / 8, one tensor-parallel rank's slice of 8) at
decode and prefill token counts, with softmax routing over random logits.
Each row gives the median time of `FusedMoE.forward_reference` (one pair of
matmuls per expert that has tokens) and of the Triton kernel, the speed-up,
and the largest absolute difference of the kernel's output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--cpu-dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import torch

from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig, select_experts

# name: (experts, top_k, hidden, intermediate)
MODELS = {"qwen-moe": (60, 4, 2048, 1408), "mixtral-tp8": (8, 2, 4096, 14336 // 8)}
TOKEN_COUNTS = (1, 16, 128, 1024, 4096)


def median_ms(fn, args: tuple, device: torch.device, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU through the interpreter")
    args = parser.parse_args()
    from pagedllm.platforms import cuda_fused_moe

    dry_run = args.cpu_dry_run
    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else getattr(torch, args.dtype)
    models = {"tiny": (6, 2, 64, 32)} if dry_run else MODELS
    token_counts = (1, 9) if dry_run else TOKEN_COUNTS
    repeats = 1 if dry_run else 20
    rows = []
    print(f"{'model':12} {'tokens':>6} {'torch ms':>9} {'triton ms':>9} {'speed-up':>8} {'max |diff|':>10}")
    for name, (num_experts, top_k, hidden, inter) in models.items():
        torch.manual_seed(0)
        layer = FusedMoE(RouterConfig(num_experts, top_k), hidden, inter)
        for param in layer.parameters():
            param.data = torch.randn(param.shape) / param.shape[-1] ** 0.5
        layer = layer.to(device=device, dtype=dtype)
        kernel = cuda_fused_moe.build(layer)
        for num_tokens in token_counts:
            x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
            topk_weights, topk_ids = select_experts(torch.randn(num_tokens, num_experts, device=device), layer.router)
            inputs = (x, topk_weights, topk_ids)
            reference_ms = median_ms(layer.forward_reference, inputs, device, repeats)
            triton_ms = median_ms(kernel, inputs, device, repeats)
            diff = (kernel(*inputs).float() - layer.forward_reference(*inputs).float()).abs().max().item()
            row = dict(model=name, tokens=num_tokens, dtype=str(dtype).removeprefix("torch."),
                       torch_ms=reference_ms, triton_ms=triton_ms, max_abs_diff=diff)
            rows.append(row)
            print(f"{name:12} {num_tokens:6d} {reference_ms:9.3f} {triton_ms:9.3f} "
                  f"{reference_ms / triton_ms:7.2f}x {diff:10.2e}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
