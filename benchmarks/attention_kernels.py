"""Paged-attention kernels: Triton vs FlashAttention (if installed) vs torch SDPA.

    python benchmarks/attention_kernels.py [--dtype float16] [--json FILE]
    python benchmarks/attention_kernels.py --cpu-dry-run   # plumbing only, via TRITON_INTERPRET=1

Decode steps (one new token per request over a long cached context) and
prefill steps (whole prompts) at several batch and sequence sizes, with a
Llama-3-8B-like head layout (32 query heads, 8 KV heads, head size 128,
16-token blocks, shuffled physical blocks). Each backend runs the full layer
forward the engine runs (cache write + attention); torch_native (gather +
`scaled_dot_product_attention`) is the reference: the table gives each
backend's median time, its speed-up over torch_native, and the largest
absolute difference of its output from torch_native's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

if "--cpu-dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit is defined

import torch

from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class Shape:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class Case:
    kind: str  # decode | prefill
    batch: int
    seq_len: int  # keys per request after the step

    @property
    def query_len(self) -> int:
        return 1 if self.kind == "decode" else self.seq_len

    def __str__(self) -> str:
        return f"{self.kind} batch={self.batch} seq={self.seq_len}"


GPU_CASES = [
    Case("decode", 1, 512),
    Case("decode", 1, 8192),
    Case("decode", 8, 2048),
    Case("decode", 32, 1024),
    Case("decode", 128, 1024),
    Case("prefill", 1, 512),
    Case("prefill", 1, 4096),
    Case("prefill", 8, 1024),
]
DRY_RUN_CASES = [Case("decode", 2, 40), Case("prefill", 1, 24)]


def make_inputs(case: Case, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-case.seq_len // shape.block_size)
    num_blocks = case.batch * blocks_per_req
    block_table = torch.randperm(num_blocks, generator=gen).view(case.batch, blocks_per_req).to(torch.int32)
    kv_cache = torch.randn(2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size, generator=gen)
    num_tokens = case.batch * case.query_len
    query = torch.randn(num_tokens, shape.num_heads, shape.head_size, generator=gen)
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_size, generator=gen)
    value = torch.randn(num_tokens, shape.num_kv_heads, shape.head_size, generator=gen)
    positions = torch.arange(case.seq_len - case.query_len, case.seq_len).repeat(case.batch)
    reqs = torch.arange(case.batch).repeat_interleave(case.query_len)
    block_numbers = block_table[reqs, positions // shape.block_size].long()
    slot_mapping = block_numbers * shape.block_size + positions % shape.block_size
    query_start_loc = torch.arange(case.batch + 1, dtype=torch.int32) * case.query_len
    seq_lens = torch.full((case.batch,), case.seq_len, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=case.batch,
        max_query_len=case.query_len,
        max_seq_len=case.seq_len,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    tensors = [t.to(device=device, dtype=dtype) for t in (query, key, value, kv_cache)]
    return (*tensors, metadata)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(
    backend: type[AttentionBackend], case: Case, shape: Shape, dtype: torch.dtype, device: torch.device,
    iters: int, warmup: int,
) -> tuple[float, torch.Tensor]:
    """(median milliseconds per layer forward, output)."""
    query, key, value, kv_cache, common = make_inputs(case, shape, dtype, device)
    impl = backend.get_impl_cls()(shape.num_heads, shape.head_size, shape.head_size**-0.5, shape.num_kv_heads)
    times = []
    output = None
    for i in range(warmup + iters):
        synchronize(device)
        start = time.perf_counter()
        # Per-batch metadata is built once per step for all layers in the engine: timed too (it is per step).
        metadata = backend.build_metadata(common, shape.block_size)
        output = impl.forward(query, key, value, kv_cache, metadata)
        synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    assert output is not None
    return statistics.median(times), output.float()


def available_backends(device: torch.device) -> list[str]:
    names = ["torch_native", "triton"]
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            names.append("flash_attn")
        except ImportError:
            pass
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    parser.add_argument("--dtype", default=None, help="float16 (GPU default), bfloat16 or float32 (dry-run default)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)

    from pagedllm.plugins import get_plugin_manager

    if args.cpu_dry_run:
        device, shape, cases = torch.device("cpu"), Shape(4, 2, 64, 16), DRY_RUN_CASES
        dtype, iters, warmup = getattr(torch, args.dtype or "float32"), args.iters or 1, 0
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-dry-run to check the plumbing", file=sys.stderr)
            return 2
        device, shape, cases = torch.device("cuda"), Shape(), GPU_CASES
        dtype, iters, warmup = getattr(torch, args.dtype or "float16"), args.iters or 20, 3
    registry = get_plugin_manager().attention_backends
    names = available_backends(device)
    backends = {name: registry.load(name) for name in names}
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) "
          f"dtype={str(dtype).removeprefix('torch.')} heads={shape.num_heads}/{shape.num_kv_heads} "
          f"head_size={shape.head_size} block_size={shape.block_size} iters={iters}")

    rows = []
    for case in cases:
        row: dict[str, object] = {"case": str(case)}
        reference = None
        for name, backend in backends.items():
            ms, output = time_backend(backend, case, shape, dtype, device, iters, warmup)
            if reference is None:
                reference, reference_ms = output, ms
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_speedup"] = round(reference_ms / ms, 2)
            row[f"{name}_max_abs_diff"] = float((output - reference).abs().max())
        rows.append(row)

    header = f"{'case':<32}" + "".join(f"{name + ' ms':>16}{'x sdpa':>8}{'max|d|':>10}" for name in names)
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['case']:<32}"
        for name in names:
            line += f"{row[f'{name}_ms']:>16.3f}{row[f'{name}_speedup']:>8.2f}{row[f'{name}_max_abs_diff']:>10.1e}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "dtype": str(dtype), "rows": rows}, f, indent=2)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    worst = max(float(row[f"{name}_max_abs_diff"]) for row in rows for name in names)
    if worst > tolerance:
        print(f"FAIL: a backend differs from torch_native by {worst:.2e} (> {tolerance:.0e})", file=sys.stderr)
        return 1
    print(f"all backends within {tolerance:.0e} of torch_native")
    return 0


if __name__ == "__main__":
    sys.exit(main())
