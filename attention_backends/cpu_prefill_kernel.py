"""The CPU fresh-prefill attention kernel (csrc/prefill_attention.c), built on first use.

A fresh prefill (no cached context) attends causally over its own rows. In
plain torch that is one `scaled_dot_product_attention(is_causal=True)` call
per request per layer plus a copy into the output rows. The kernel does
every fresh prefill of the layer in one call, writing straight into the
output rows: flash-style blocks of 16 query rows x one KV head as parallel
work items (torch's OpenMP team), an online softmax in float32 over
512-key chunks. Scores and P.V run on AMX tiles for bfloat16 where the CPU
and kernel allow it (P multiplied as two bf16 parts, so it keeps ~17 bits:
SDPA rounds it to 8), on AVX512-BF16 dot products or float32 FMAs
otherwise.

What it saves on a prefill step is measured by `benchmarks/step_profile.py`
(the numbers: docs/performance.md).

Built and loaded like cpu_decode_kernel.py (plain C, ctypes, the system C
compiler). It needs AVX-512; without it, without a compiler, or with
`PAGEDLLM_CPU_PREFILL_KERNEL=0`, `supports()` is False and the `cpu` backend
keeps SDPA. Soft capping, sliding windows shorter than the prompt, head
sizes that are not a multiple of 16 (or over 256) and fp8 caches keep SDPA
too.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from pagedllm.platforms.cpu.graph import kernel_call
from pagedllm.platforms.cpu.kernel_build import load_library

SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.c"
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_SIZE = 256  # and a multiple of 16 (csrc/prefill_attention.c)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_PREFILL_KERNEL"

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_ARGTYPES: list[Any] = [_INT, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _INT, _INT, _INT, _F32, _INT,
                        _PTR]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be built or
    the CPU lacks AVX-512 (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU prefill-attention kernel")
    if library is None or not library.prefill_attention_available():
        return None
    library.prefill_attention.restype = ctypes.c_int
    library.prefill_attention.argtypes = _ARGTYPES
    return library


def supports(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    sliding_window: int | None,
    soft_cap: float | None,
    max_query_len: int,
) -> bool:
    """Whether the kernel can run this layer's fresh prefills (and is built)."""
    head_size = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype in KERNEL_DTYPES
        and key.dtype == value.dtype == query.dtype
        and all(_heads_contiguous(x) for x in (query, key, value))
        and soft_cap is None
        and (sliding_window is None or sliding_window >= max_query_len)
        and num_kv_heads > 0
        and num_heads % num_kv_heads == 0
        and head_size % 16 == 0
        and head_size <= MAX_HEAD_SIZE
        and load() is not None
    )


def _heads_contiguous(x: torch.Tensor) -> bool:
    """Whether [T, heads, D] rows are strided but each row's heads and dims contiguous."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _row_view(x: torch.Tensor) -> int:
    """Row stride of a [T, heads, D] view whose heads and head dims are contiguous."""
    if not _heads_contiguous(x):
        raise ValueError(f"prefill kernel needs contiguous heads and head dims, got strides {x.stride()}")
    return x.stride(0)


def prefill_attention(
    query: torch.Tensor,  # [T, H, D]: rows of every fresh prefill; heads and head dims contiguous
    key: torch.Tensor,  # [T, Hkv, D], same rows
    value: torch.Tensor,  # [T, Hkv, D]
    out: torch.Tensor,  # [T, H, D], written in place
    rows: torch.Tensor,  # int64 [R, 2], contiguous: request r owns rows [rows[r, 0], rows[r, 1])
    scale: float,
    allow_amx: bool = True,
    sinks: torch.Tensor | None = None,  # [H]: each query head's sink logit (its probability dropped)
) -> None:
    """Causal attention of each request's rows over its own rows, into `out`."""
    library = load()
    if library is None:
        raise RuntimeError("the CPU prefill-attention kernel is not built; check supports() first")
    tensors = (query, key, value, out)
    if any(t.dtype != query.dtype for t in tensors) or rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError("prefill kernel: q, k, v and out must share a dtype; rows must be contiguous int64")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    if sink_logits is not None and sink_logits.numel() != num_heads:
        raise ValueError(f"prefill kernel: {sink_logits.numel()} sinks for {num_heads} heads")
    status = kernel_call(
        library.prefill_attention, KERNEL_DTYPES[query.dtype], query, _row_view(query), key, _row_view(key), value,
        _row_view(value), out, _row_view(out), rows, rows.shape[0], num_heads, num_kv_heads, head_size, scale,
        int(allow_amx), sink_logits,
    )
    if status != 0:
        raise RuntimeError(f"prefill_attention kernel: unsupported shape (heads {num_heads}/{num_kv_heads}, "
                           f"head size {head_size}) or out of memory")
