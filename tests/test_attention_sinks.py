"""Attention sinks (GPT-OSS) in every kernel, against plain torch.

A sink is one learned logit per query head that joins each row's softmax
(after any soft cap) and whose probability is dropped: the row's output is
softmax([scores, sink])[:-1] @ V (transformers' gpt_oss eager_attention_forward).
The sinks below take 5-60 % of a row's mass, so a kernel that ignores them is
off by far more than the tolerance (`test_the_sinks_matter`).
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

import pytest
import torch
from helpers.attention_case import DEVICE, build_case, run_backend
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags

from pagedllm.attention_backends import cpu_decode_kernel, cpu_prefill_kernel
from pagedllm.attention_backends.torch_native import TorchNativeBackend

NUM_HEADS, NUM_KV_HEADS = 4, 2  # GQA: two query heads per KV head
# A prefill chunk with cached context, a fresh prefill, and decodes.
MIXED = dict(seq_lens=[37, 20, 50, 9, 33], query_lens=[12, 20, 1, 1, 1])
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def sinks_for(num_heads: int) -> torch.Tensor:
    return torch.linspace(-1.0, 4.0, num_heads)


def reference(case_requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float,
              sinks: torch.Tensor | None, sliding_window: int | None = None,
              soft_cap: float | None = None) -> torch.Tensor:
    """[T, H, D] float64: every request's query rows over its keys, causal on
    absolute positions, with the sinks in each softmax."""
    outs = []
    for query, keys, values in case_requests:
        q_len, num_heads, _ = query.shape
        seq_len, num_kv_heads, _ = keys.shape
        k = keys.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, D]
        v = values.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,shd->hqs", query.double(), k) * scale  # [H, q, S]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks.double().cpu().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hqs,shd->qhd", probs, v))
    return torch.cat(outs)


def backend_vs_reference(backend: type, dtype: torch.dtype = torch.float32, **case_args: object
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    args = {**MIXED, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, **case_args}
    case = build_case(dtype=dtype, sinks=sinks_for(int(args["num_heads"])), **args)  # type: ignore[arg-type]
    out, _ = run_backend(backend, case)
    return out.double().cpu(), reference(case.requests, case.head_size**-0.5, case.sinks, case.sliding_window,
                                         case.soft_cap)


def test_the_sinks_matter() -> None:
    """The same batch without sinks is far from the reference with them."""
    case = build_case(**MIXED, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, sinks=sinks_for(NUM_HEADS))
    with_sinks = reference(case.requests, case.head_size**-0.5, case.sinks)
    without = reference(case.requests, case.head_size**-0.5, None)
    assert (with_sinks - without).abs().max() > 0.1


# ------------------------------------------------------------- cpu backend


@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_cpu_backend_with_sinks_matches_the_reference(monkeypatch: pytest.MonkeyPatch, sliding_window: int | None,
                                                      kernels: str) -> None:
    """Decodes, a chunk with context and a fresh prefill: on the C kernels
    (where this machine builds them), and on the torch path alone."""
    if kernels == "off":
        monkeypatch.setattr(cpu_decode_kernel, "supports", lambda *args: False)
        monkeypatch.setattr(cpu_prefill_kernel, "supports", lambda *args: False)
    out, ref = backend_vs_reference(TorchNativeBackend, sliding_window=sliding_window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_cpu_backend_with_sinks_and_a_soft_cap() -> None:
    """The sink joins the softmax after the cap (it is not capped itself)."""
    out, ref = backend_vs_reference(TorchNativeBackend, soft_cap=1.5, num_heads=8, num_kv_heads=2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------- the C kernels


def decode_kernel_vs_reference(query_len: int = 1, **case_args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, float64 reference) for `query_len` rows per request
    (1: decodes; more: a verify step), GQA 8/2, the rows' K/V written by the kernel."""
    seq_lens = [1, 17, 40, 16, 95, 3] if query_len == 1 else [5, 17, 40, 16, 95, query_len]
    args = {"num_heads": 8, "num_kv_heads": 2, "head_size": 64, **case_args}
    sinks = sinks_for(int(args["num_heads"]))  # type: ignore[call-overload]
    case = build_case(seq_lens, [query_len] * len(seq_lens), sinks=sinks, **args)  # type: ignore[arg-type]
    key_cache = case.kv_cache[0].view(-1, case.num_kv_heads, case.head_size)
    value_cache = case.kv_cache[1].view(-1, case.num_kv_heads, case.head_size)
    out = cpu_decode_kernel.paged_decode(
        case.query, key_cache, value_cache, case.block_size, case.metadata.block_table, case.metadata.seq_lens_cpu,
        case.head_size**-0.5, case.sliding_window, case.soft_cap, (case.key, case.value, case.metadata.slot_mapping),
        query_len=query_len, sinks=sinks,
    )
    return out.double(), reference(case.requests, case.head_size**-0.5, sinks, case.sliding_window, case.soft_cap)


@NO_COMPILER
@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("sliding_window", [None, 10])
def test_decode_kernel_with_sinks(head_size: int, sliding_window: int | None) -> None:
    out, ref = decode_kernel_vs_reference(head_size=head_size, sliding_window=sliding_window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@NO_COMPILER
def test_decode_kernel_verify_rows_with_sinks() -> None:
    """q > 1 rows per request fold into one pass: each folded head keeps its own head's sink."""
    if cpu_decode_kernel.load() is None:
        pytest.skip("the decode kernel is not built here")
    out, ref = decode_kernel_vs_reference(query_len=3, sliding_window=12)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@NO_COMPILER
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags(), reason="an x86-64-v3 build")
def test_decode_kernel_portable_build_with_sinks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable C loop (a build without AVX-512) takes the sinks too."""
    library = build_for_march(cpu_decode_kernel.SOURCE, cpu_decode_kernel.CFLAGS, "x86-64-v3", tmp_path)
    library.paged_decode.restype = ctypes.c_int
    library.paged_decode.argtypes = cpu_decode_kernel._ARGTYPES
    monkeypatch.setattr(cpu_decode_kernel, "load", lambda: library)
    out, ref = decode_kernel_vs_reference(sliding_window=10)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@NO_COMPILER
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_prefill_kernel_with_sinks(num_heads: int, num_kv_heads: int) -> None:
    """Every fresh prefill of a layer in one call, prompts over a 256-key softmax chunk."""
    if cpu_prefill_kernel.load() is None:
        pytest.skip("the prefill kernel needs AVX-512 and a C compiler")
    lengths = [5, 300, 33]
    sinks = sinks_for(num_heads)
    case = build_case(lengths, lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32, sinks=sinks)
    out = torch.empty_like(case.query)
    bounds = torch.tensor([[0, 5], [5, 305], [305, 338]], dtype=torch.int64)
    cpu_prefill_kernel.prefill_attention(case.query, case.key, case.value, out, bounds, case.head_size**-0.5,
                                         sinks=sinks)
    torch.testing.assert_close(out.double(), reference(case.requests, case.head_size**-0.5, sinks),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- triton

needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and DEVICE.type != "cuda",
    reason="needs the Triton interpreter or a CUDA device",
)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_triton_with_sinks(dtype: torch.dtype, sliding_window: int | None) -> None:
    triton_backend = pytest.importorskip("pagedllm.attention_backends.triton")
    out, ref = backend_vs_reference(triton_backend.TritonBackend, dtype=dtype, sliding_window=sliding_window)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


@needs_triton
def test_triton_split_kv_decode_with_sinks() -> None:
    """Split-KV: the segments ignore the sinks; the merge adds them once."""
    unified = pytest.importorskip("pagedllm.attention_backends.triton.unified_attention")
    sinks = sinks_for(NUM_HEADS)
    case = build_case([70, 41], [1, 1], num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, sinks=sinks)
    kv_cache = case.kv_cache.clone()
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, case.head_size)
    flat[0, case.metadata.slot_mapping.long()] = case.key
    flat[1, case.metadata.slot_mapping.long()] = case.value
    out = torch.empty_like(case.query)
    meta = case.metadata
    unified.unified_attention(out, case.query, kv_cache[0], kv_cache[1], meta.block_table, meta.seq_lens,
                              meta.query_start_loc, num_reqs=2, max_query_len=1, scale=case.head_size**-0.5,
                              num_segments=3, sinks=case.sinks)
    torch.testing.assert_close(out.double().cpu(), reference(case.requests, case.head_size**-0.5, sinks),
                               atol=2e-5, rtol=2e-5)
