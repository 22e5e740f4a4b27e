"""One paged-attention batch, built once and run through any backend (the
attention suite's cases, and the repository's attention tests').

A case is a flattened mixed batch (prefill chunks with cached context,
fresh prefills, decodes) over a KV cache whose unwritten slots hold NaN, with
shuffled (non-contiguous) physical blocks. `run_backend` writes the step's
new K/V through the backend and returns its output and the cache after.

The device is PAGEDLLM_TEST_DEVICE (default cpu): benchmarks/gpu_check.sh
runs the same cases on a GPU with TRITON_INTERPRET=0.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata

DEVICE = torch.device(os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu"))


@dataclass
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D], the step's new keys
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], cached context written, the rest NaN
    metadata: AttentionMetadata
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: torch.Tensor | None = None  # float32 [H] on the device: each query head's sink logit
    # Per request, on the CPU: (query [q_len, H, D], every key and value
    # [seq_len, Hkv, D]): what a reference implementation attends over.
    requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


def paged_metadata(
    query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, slots: list[int]
) -> AttentionMetadata:
    """The common metadata of a flattened batch, on the CPU: request r's
    ``query_lens[r]`` new tokens are the last of its ``seq_lens[r]``, and
    ``slots`` are the cache slots of all the new tokens in batch order."""
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=sum(query_lens),
        num_reqs=len(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
    )


def build_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    seed: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionCase:
    """`kv_cache_dtype` (an fp8 dtype): the cache is stored in it (the
    cached context converted by plain torch, unwritten slots NaN), and the
    reference's keys and values are converted to it and back, as an fp8
    cache with scale 1.0 holds them."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(num_reqs, max(blocks_per_req) + 1, dtype=torch.int32)
    tables = []
    for r, n in enumerate(blocks_per_req):
        table = [block_ids.pop() for _ in range(n)]
        tables.append(table)
        block_table[r, :n] = torch.tensor(table, dtype=torch.int32)

    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    flat_k = kv_cache[0].view(-1, num_kv_heads, head_size)
    flat_v = kv_cache[1].view(-1, num_kv_heads, head_size)

    def slot(r: int, pos: int) -> int:
        return tables[r][pos // block_size] * block_size + pos % block_size

    queries, new_keys, new_values, slots, requests = [], [], [], [], []
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        keys = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        queries.append(torch.randn(q_len, num_heads, head_size, generator=gen).to(dtype))
        for pos in range(seq_len - q_len):  # cached context, written by earlier steps
            flat_k[slot(r, pos)] = keys[pos]
            flat_v[slot(r, pos)] = values[pos]
        if kv_cache_dtype is None:
            requests.append((queries[-1], keys, values))
        else:  # what the reference attends over: the values round-tripped through the cache's dtype
            requests.append((queries[-1], keys.to(kv_cache_dtype).to(dtype), values.to(kv_cache_dtype).to(dtype)))
        new_keys.append(keys[seq_len - q_len :])
        new_values.append(values[seq_len - q_len :])
        slots += [slot(r, pos) for pos in range(seq_len - q_len, seq_len)]

    if kv_cache_dtype is not None:
        kv_cache = kv_cache.to(kv_cache_dtype)  # NaN stays NaN
    metadata = paged_metadata(query_lens, seq_lens, block_table, slots)
    on_device = {name: getattr(metadata, name).to(DEVICE) for name in
                 ("query_start_loc", "seq_lens", "block_table", "slot_mapping")}
    return AttentionCase(
        num_heads, num_kv_heads, head_size, block_size, num_blocks,
        torch.cat(queries).to(DEVICE), torch.cat(new_keys).to(DEVICE), torch.cat(new_values).to(DEVICE),
        kv_cache.to(DEVICE), dataclasses.replace(metadata, **on_device), sliding_window, soft_cap,
        None if sinks is None else sinks.to(DEVICE), requests,
    )


def run_backend(backend: type[AttentionBackend], case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H, D], KV cache after the step) of `backend` on a copy of the case's cache."""
    kv_cache = case.kv_cache.clone()
    metadata = backend.build_metadata(case.metadata, case.block_size)
    extra = {} if case.sinks is None else {"sinks": case.sinks}  # a backend written before sinks takes none
    impl = backend.get_impl_cls()(
        case.num_heads,
        case.head_size,
        case.head_size**-0.5,
        case.num_kv_heads,
        sliding_window=case.sliding_window,
        logits_soft_cap=case.soft_cap,
        **extra,
    )
    out = impl.forward(case.query.clone(), case.key.clone(), case.value.clone(), kv_cache, metadata)
    return out, kv_cache
