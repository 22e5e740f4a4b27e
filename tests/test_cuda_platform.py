"""The CUDA platform on a simulated device: dtype rules with the backend
they lead to, and the KV budget from a profiled peak."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest
import torch

from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cuda import CudaPlatform

GiB = 1 << 30
_real_find_spec = importlib.util.find_spec


def simulate_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], installed: tuple[str, ...]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in ("triton", "flash_attn"):
            return object() if name in installed else None
        return _real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_bf16_checkpoint_on_turing_runs_fp16_with_a_warning_on_the_triton_backend(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    simulate_cuda(monkeypatch, (7, 5), installed=("triton", "flash_attn"))
    platform = resolve_platform("auto")
    with caplog.at_level(logging.WARNING, logger="pagedllm.platforms.cuda"):
        dtype = platform.resolve_dtype("auto", torch.bfloat16)
    assert dtype == torch.float16
    assert "cannot compute in bfloat16 (needs compute capability >= 8.0)" in caplog.text
    assert "runs in float16" in caplog.text
    selection = select_attention_backend(platform, "auto", head_size=128, dtype=dtype, block_size=16, load=False)
    assert selection.name == "triton"
    assert selection.rejected == {"flash_attn": ["compute capability 7.5 < 8.0 required"]}


@pytest.mark.parametrize(("capability", "installed", "expected"), [
    ((8, 0), ("triton", "flash_attn"), "flash_attn"),
    ((8, 0), ("triton",), "triton"),
    ((9, 0), ("triton", "flash_attn"), "flash_attn"),
    ((9, 0), ("triton",), "triton"),
])
def test_bf16_checkpoint_on_ampere_and_hopper_stays_bf16(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capability: tuple[int, int], installed: tuple[str, ...], expected: str,
) -> None:
    simulate_cuda(monkeypatch, capability, installed)
    platform = resolve_platform("auto")
    with caplog.at_level(logging.WARNING, logger="pagedllm.platforms.cuda"):
        dtype = platform.resolve_dtype("auto", torch.bfloat16)
    assert dtype == torch.bfloat16 and caplog.text == ""
    selection = select_attention_backend(platform, "auto", head_size=128, dtype=dtype, block_size=16, load=False)
    assert selection.name == expected


def test_kv_budget_is_free_memory_times_utilization_minus_the_profiled_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    allocated = {"now": 3 * GiB, "peak": 3 * GiB}
    calls = []

    def profile_run() -> None:
        calls.append("profile")
        allocated["peak"] = allocated["now"] + 2 * GiB  # activations, freed again

    for name, fn in {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: allocated.__setitem__("peak", allocated["now"]),
        "mem_get_info": lambda device=None: (10 * GiB, 16 * GiB),
        "memory_allocated": lambda device=None: allocated["now"],
        "max_memory_allocated": lambda device=None: allocated["peak"],
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    budget = CudaPlatform().kv_cache_budget_bytes(0.9, profile_run)
    assert calls == ["profile"]
    assert budget == int(10 * GiB * 0.9) - 2 * GiB
