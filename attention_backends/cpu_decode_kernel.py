"""The CPU paged-decode kernel (csrc/paged_decode.c), built on first use.

Decode attention in plain torch gathers every request's keys and values out
of the paged cache into a padded copy, then runs SDPA over it: the 100M
Llama's decode step at batch 32 spent ~40 % of its time there. The kernel
reads each request's own keys and values in place through its block table,
one pass over K and one over V, 16 tokens at a time with AVX-512 where the
CPU has it, float32 softmax and accumulation: 0.45x the time of gather +
SDPA per layer at batch 32, contexts 65-320, bfloat16 (0.30x in float32),
one thread (`benchmarks/paged_decode.py`, `benchmarks/step_profile.py`).

It is plain C loaded with ctypes, not a torch extension: building it takes
the system C compiler about a second (no torch headers, no ninja), once per
source version and CPU, into `$PAGEDLLM_CACHE_DIR/kernels/`. Without a
compiler, or when `PAGEDLLM_CPU_DECODE_KERNEL=0`, `load()` returns None and
the `cpu` backend (torch_native.py) keeps its gather + SDPA path; the reason is logged once.

It is built with OpenMP and links `libgomp.so.1`, which torch (imported
first) has already loaded: its parallel loop over requests runs on torch's
own thread team, at torch.get_num_threads() threads. Python threads (ctypes
releases the GIL) gained nothing at 2 threads: torch's idle OpenMP threads
spin for a while after each op and held the second core.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pagedllm.platforms.cpu.graph import kernel_call
from pagedllm.platforms.cpu.kernel_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# Storage dtypes the kernel reads (its `dtype` argument).
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_GROUP = 64  # query heads per KV head (csrc/paged_decode.c)
MAX_HEAD_SIZE = 512
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_DECODE_KERNEL"

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES: list[Any] = [_INT, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64,
                        _I64, _INT, _INT, _INT, _INT, _F32, _I64, _F32, _I64, _PTR]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU paged-decode kernel")
    if library is not None:
        library.paged_decode.restype = ctypes.c_int
        library.paged_decode.argtypes = _ARGTYPES
    return library


def supports(query: torch.Tensor, key_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel can run this layer's decode (and is built)."""
    return (
        key_cache.device.type == "cpu"
        and key_cache.dtype in KERNEL_DTYPES
        and query.dtype == key_cache.dtype
        and num_heads // num_kv_heads <= MAX_GROUP
        and query.shape[-1] <= MAX_HEAD_SIZE
        and load() is not None
    )


def takes_new_kv(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether paged_decode can write these rows itself (`new_kv`)."""
    row = key_cache.shape[1:]
    return (
        slots.dtype == torch.int64 and slots.is_contiguous() and key.shape[0] == value.shape[0] == slots.numel()
        and all(x.dtype == key_cache.dtype and x.shape[1:] == row and x.stride(2) == 1 and x.stride(1) == row[1]
                for x in (key, value))
    )


def paged_decode(
    query: torch.Tensor,  # [B * q, H, D], q rows per request; heads and head dims contiguous
    key_cache: torch.Tensor,  # [num_blocks * block_size, Hkv, D]: flat slots, heads and head dims contiguous
    value_cache: torch.Tensor,  # same shape and strides
    block_size: int,
    block_table: torch.Tensor,  # int32 [B, W], rows contiguous
    seq_lens: torch.Tensor,  # int32 [B], contiguous; request r's last row attends to its positions < seq_lens[r]
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    query_len: int = 1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [B * q, H, D]
    """Attention of each request's `query_len` (q) newest tokens over its
    cached keys: row i of request r (its row r * q + i) attends to positions
    < seq_lens[r] - (q - 1 - i), causally over the request's rows before it
    (q = 1: a decode step; q = 1 + k: a verify step in which every request
    scores k drafts).

    `new_kv` (key [B * q, Hkv, D], value [B * q, Hkv, D], int64 slots
    [B * q]): each row's new key and value, all written to their slots in
    the caches before any row attends (what write_kv would do before the
    call). Their heads and head dims must be contiguous (`takes_new_kv`).

    `sinks` ([H], any float dtype): each query head's sink logit, in every
    row's softmax after the soft cap, its probability mass dropped."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU paged-decode kernel is not built; check supports() first")
    num_rows, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[1]
    if query_len < 1 or num_rows != seq_lens.numel() * query_len:
        raise ValueError(f"paged_decode: {num_rows} query rows for {seq_lens.numel()} requests of {query_len}")
    if query.stride(2) != 1 or query.stride(1) != head_size:
        query = query.contiguous()
    out = torch.empty(num_rows, num_heads, head_size, dtype=query.dtype)
    new_rows: tuple[torch.Tensor | None, int, torch.Tensor | None, int, torch.Tensor | None] = (None, 0, None, 0, None)
    if new_kv is not None:
        key, value, slots = new_kv
        if not takes_new_kv(key, value, slots, key_cache) or slots.numel() != num_rows:
            raise ValueError("paged_decode: new_kv must be [B * q, Hkv, D] rows with contiguous heads and int64 slots")
        new_rows = (key, key.stride(0), value, value.stride(0), slots)
    leading = (
        KERNEL_DTYPES[key_cache.dtype], query, query.stride(0), key_cache, value_cache, key_cache.stride(0),
        block_table, block_table.stride(0), seq_lens, out, *new_rows,
    )
    # NOTE: float32 [H] kept by the call (a captured graph holds it): its pointer is read at replay.
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    if sink_logits is not None and sink_logits.numel() != num_heads:
        raise ValueError(f"paged_decode: {sink_logits.numel()} sinks for {num_heads} heads")
    trailing = (num_heads, num_kv_heads, head_size, block_size, scale, sliding_window or 0, soft_cap or 0.0, query_len,
                sink_logits)

    if kernel_call(library.paged_decode, *leading, 0, num_rows, *trailing) != 0:
        raise RuntimeError(f"paged_decode kernel: unsupported shape (heads {num_heads}/{num_kv_heads}, "
                           f"head size {head_size}) or out of memory")
    return out
