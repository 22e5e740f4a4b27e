"""The KV cache's storage dtype (`cache.cache_dtype`, vLLM's `--kv-cache-dtype`).

``auto`` stores keys and values in the model's compute dtype. ``fp8`` (=
``fp8_e4m3``, torch.float8_e4m3fn, range +-448, 3 mantissa bits) and
``fp8_e5m2`` (torch.float8_e5m2, range +-57344, 2 mantissa bits) store them
in one byte: a block takes half the bytes of a bfloat16 one (a quarter of a
float32 one), so the same memory holds twice (four times) the blocks.

Like vLLM, an fp8 cache has a per-tensor scale for keys and one for values
(`k_scale`, `v_scale`): the cache holds ``(x / scale)`` converted to fp8,
saturated at the format's largest finite value, and attention reads
``cache.to(compute dtype) * scale``. Both are 1.0 (vLLM's default) unless
the checkpoint carries them (compressed-tensors' `kv_cache_scheme`: its
quantization method sets the attention impl's `k_scale` / `v_scale`).

A backend that stores an fp8 cache declares it (the ``kv_cache_dtypes``
registration key); its impl writes with `quantize_kv` and reads with
`dequantize_kv`. Indexing ops that torch lacks for float8 on some devices
(``index_copy_`` on the CPU) go through `as_bytes`, a uint8 view of the same
memory (bit-exact).
"""

from __future__ import annotations

import torch

# The names and their dtypes are the platform's (it answers whether a device
# can store one); this module is how a backend stores and reads them.
from pagedllm.platforms.interface import (
    FP8_CACHE_DTYPES,
    FP8_DTYPES,
    KV_CACHE_DTYPE_NAMES,
    is_fp8,
    resolve_kv_cache_dtype,
)

# The per-tensor scale of an fp8 KV cache (vLLM's k_scale / v_scale) where
# the checkpoint provides none.
DEFAULT_KV_SCALE = 1.0


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = DEFAULT_KV_SCALE) -> torch.Tensor:
    """`x` as the cache stores it: unchanged in a compute-dtype cache, else
    ``(x / scale)`` saturated to the fp8 range and converted (a value past
    the range would otherwise be NaN in E4M3, inf in E5M2)."""
    if x.dtype == cache_dtype:
        return x
    if scale != 1.0:
        x = x / scale
    limit = torch.finfo(cache_dtype).max
    return x.clamp(-limit, limit).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = DEFAULT_KV_SCALE) -> torch.Tensor:
    """Cache contents `x` back in the compute dtype."""
    if x.dtype == dtype:
        return x
    if x.device.type == "cpu" and is_fp8(x.dtype):
        # NOTE: torch converts float8 on the CPU one element at a time; a
        # 256-entry table of its own conversions, indexed by the bytes, is
        # the same values (bit for bit) at a fraction of the time.
        table = _dequantize_table(x.dtype, dtype)
        x = table.index_select(0, x.view(torch.uint8).reshape(-1).long()).view(x.shape)
    else:
        x = x.to(dtype)
    return x if scale == 1.0 else x * scale


_DEQUANTIZE_TABLES: dict[tuple[torch.dtype, torch.dtype], torch.Tensor] = {}


def _dequantize_table(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Every byte value of `fp8_dtype` converted to `dtype` by torch (on the CPU)."""
    table = _DEQUANTIZE_TABLES.get((fp8_dtype, dtype))
    if table is None:
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(dtype)
        _DEQUANTIZE_TABLES[fp8_dtype, dtype] = table
    return table


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor (the same memory), for the index ops
    torch does not implement for float8; any other tensor as it is."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = DEFAULT_KV_SCALE) -> None:
    """``cache[slots] = x`` as the cache stores it (`quantize_kv`); `cache`
    is one of K or V viewed as flat slots [num_slots, Hkv, D]."""
    as_bytes(cache).index_copy_(0, slots, as_bytes(quantize_kv(x, cache.dtype, scale)))


def read_kv(
    cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, scale: float = DEFAULT_KV_SCALE
) -> torch.Tensor:
    """``cache[slots]`` in the compute dtype `dtype` (`dequantize_kv`)."""
    if not is_fp8(cache.dtype):
        return cache.index_select(0, slots)
    return dequantize_kv(as_bytes(cache).index_select(0, slots).view(cache.dtype), dtype, scale)


__all__ = [
    "DEFAULT_KV_SCALE",
    "FP8_CACHE_DTYPES",
    "FP8_DTYPES",
    "KV_CACHE_DTYPE_NAMES",
    "as_bytes",
    "dequantize_kv",
    "is_fp8",
    "quantize_kv",
    "read_kv",
    "resolve_kv_cache_dtype",
    "write_kv",
]
