"""The KV cache tensors: zeros of the backend's shape, one per layer; on the
CPU their pages are not written at allocation (a fresh anonymous mapping the
kernel zero-fills on first touch), so a large cache costs nothing at start."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pagedllm.model_registry.kv_cache import zeroed_tensor


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_kv_tensor_is_zero_writable_and_its_own_memory() -> None:
    shape = (2, 7, 16, 2, 8)
    first, second = zeroed_tensor(shape, torch.bfloat16, "cpu"), zeroed_tensor(shape, torch.bfloat16, "cpu")
    for tensor in (first, second):
        assert tensor.shape == shape and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        assert torch.equal(tensor, torch.zeros(shape, dtype=torch.bfloat16))
    first[1, 3].fill_(2.5)
    assert first[1, 3].eq(2.5).all() and first.sum().item() == 2.5 * 16 * 2 * 8
    assert torch.equal(second, torch.zeros(shape, dtype=torch.bfloat16))


def test_a_large_cpu_kv_tensor_is_not_written_at_allocation() -> None:
    before = resident_bytes()
    cache = zeroed_tensor((1024, 16, 16, 2, 64), torch.float32, torch.device("cpu"))  # 256 MiB
    assert resident_bytes() - before < 32 << 20
    cache[5].fill_(1.0)  # touched pages become resident, the rest stay zero
    assert cache[5].eq(1.0).all() and cache[6].eq(0.0).all()
    assert resident_bytes() - before < 32 << 20


def test_an_empty_shape_is_an_empty_zero_tensor() -> None:
    assert zeroed_tensor((0, 16, 2, 8), torch.float32, "cpu").shape == (0, 16, 2, 8)
