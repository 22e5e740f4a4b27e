"""The FlashAttention backend's plumbing, on CPU.

`flash_attn` needs a GPU, so a plain-torch stand-in with its documented
semantics (varlen batches by cu_seqlens, causal mask aligned to the bottom
right, window_size=(left, right), softcap, paged K/V through block_table) is
installed as the `flash_attn` module. What this proves: the backend passes
the right batch description, gathers keys correctly when the block size is
not one FlashAttention pages over (reading in place when it is), and equals
torch_native. The kernel itself is exercised by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import pytest
import torch
from helpers.attention_case import build_case, run_backend

from pagedllm.attention_backends.torch_native import TorchNativeBackend


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[-2]
    for r in range(len(cu_seqlens_q) - 1):
        q_start, q_end = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        num_keys = int(cu_seqlens_k[r + 1] - cu_seqlens_k[r])
        assert q_end - q_start <= max_seqlen_q and num_keys <= max_seqlen_k
        if block_table is None:
            keys = k[int(cu_seqlens_k[r]) : int(cu_seqlens_k[r + 1])]
            values = v[int(cu_seqlens_k[r]) : int(cu_seqlens_k[r + 1])]
        else:
            page = k.shape[1]
            pos = torch.arange(num_keys)
            keys = k[block_table[r, pos // page].long(), pos % page]
            values = v[block_table[r, pos // page].long(), pos % page]
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys) * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(q_end - q_start)[:, None] + num_keys - (q_end - q_start)  # bottom right
        key_pos = torch.arange(num_keys)[None, :]
        allowed = key_pos <= query_pos if causal else torch.ones_like(key_pos <= query_pos)
        if window_size[0] >= 0:
            allowed = allowed & (key_pos >= query_pos - window_size[0])
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    # Only the tests that run the backend write the cache; the pure-index tests run everywhere.
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("cache writes need the Triton interpreter")
    calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return reference_varlen(*args, **kwargs)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


MIXED = dict(seq_lens=[37, 20, 50, 9, 33], query_lens=[12, 20, 1, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_gathered_keys_for_block_size_16_equal_torch_native(fake_flash_attn: list, dtype: torch.dtype) -> None:
    from pagedllm.attention_backends.flash_attn import FlashAttentionBackend

    case = build_case(**MIXED, dtype=dtype)
    expected, expected_cache = run_backend(TorchNativeBackend, case)
    out, cache = run_backend(FlashAttentionBackend, case)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0, equal_nan=True)
    (call,) = fake_flash_attn
    assert call["block_table"] is None and call["causal"] is True
    assert call["cu_seqlens_k"].tolist() == [0, 37, 57, 107, 116, 149]
    assert call["cu_seqlens_q"].tolist() == [0, 12, 32, 33, 34, 35]
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (20, 50)


def test_block_size_256_reads_the_cache_in_place(fake_flash_attn: list) -> None:
    from pagedllm.attention_backends.flash_attn import FlashAttentionBackend

    case = build_case(seq_lens=[300, 20, 513], query_lens=[44, 20, 1], block_size=256)
    expected, _ = run_backend(TorchNativeBackend, case)
    out, _ = run_backend(FlashAttentionBackend, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    (call,) = fake_flash_attn
    assert call["block_table"] is case.metadata.block_table


def test_sliding_window_and_soft_cap_are_passed_in_flash_attn_terms(fake_flash_attn: list) -> None:
    from pagedllm.attention_backends.flash_attn import FlashAttentionBackend

    case = build_case(**MIXED)
    case.sliding_window, case.soft_cap = 8, 3.0
    expected, _ = run_backend(TorchNativeBackend, case)
    out, _ = run_backend(FlashAttentionBackend, case)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert fake_flash_attn[0]["window_size"] == (7, 0) and fake_flash_attn[0]["softcap"] == 3.0


def test_key_slots_follow_the_block_table() -> None:
    from pagedllm.attention_backends.flash_attn import build_key_slots

    block_table = torch.tensor([[5, 2, 0], [7, 0, 0]], dtype=torch.int32)
    slots = build_key_slots(torch.tensor([5, 2], dtype=torch.int32), block_table, block_size=4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 28, 29]
