"""The CPU fresh-prefill attention kernel (attention_backends/csrc/prefill_attention.c)
against a float64 causal reference in plain torch, and its use by torch_native.

Every case runs several requests of different lengths in one call, as the
backend does: their q, k and v are slices of one wider fused qkv row (so the
row strides are not the heads' size), with rows of NaN between requests and
after the last one, so reading another request's rows, or past a request,
shows. Lengths straddle the kernel's 16-row blocks and 512-key softmax
chunks; head sizes 32 and 80 are not multiples of AMX's 32-dim tiles.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch
from helpers.attention_case import build_case, run_backend
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags

from pagedllm.attention_backends import cpu_prefill_kernel
from pagedllm.attention_backends.torch_native import TorchNativeBackend

pytestmark = [NO_COMPILER, pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags(),
                                              reason="the kernel needs AVX-512")]

LENGTHS = [1, 5, 16, 17, 64, 160, 513]
HEAD_SIZES = [64, 128, 80, 32]
GROUPS = [1, 3, 8]  # query heads per KV head
GAP = 3  # NaN rows between requests


def make_rows(lengths: list[int], num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, H, D], k, v [T, Hkv, D], rows int64 [R, 2]): views of one qkv
    tensor with 8 spare columns per row, NaN outside the requests' rows."""
    gen = torch.Generator().manual_seed(seed)
    bounds, start = [], 0
    for length in lengths:
        bounds.append((start, start + length))
        start += length + GAP
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.full((start, width + 8), float("nan"))
    for begin, end in bounds:
        qkv[begin:end, :width] = torch.randn(end - begin, width, generator=gen)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_size].view(start, num_heads, head_size)
    k = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(start, num_kv_heads, head_size)
    v = qkv[:, (num_heads + num_kv_heads) * head_size : width].view(start, num_kv_heads, head_size)
    return q, k, v, torch.tensor(bounds, dtype=torch.int64)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 [T, H, D]: each request's rows attend causally over its own rows (NaN elsewhere)."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for begin, end in rows.tolist():
        qq = q[begin:end].double().transpose(0, 1)  # [H, L, D]
        kk = k[begin:end].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vv = v[begin:end].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qq @ kk.transpose(1, 2) * scale
        causal = torch.ones(end - begin, end - begin, dtype=torch.bool).tril()
        out[begin:end] = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out


def run_kernel(lengths: list[int], num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
               allow_amx: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel output, float64 reference, rows) with the output pre-filled with 7.0."""
    q, k, v, rows = make_rows(lengths, num_heads, num_kv_heads, head_size, dtype)
    out = torch.full(q.shape, 7.0, dtype=dtype)
    scale = head_size**-0.5
    cpu_prefill_kernel.prefill_attention(q, k, v, out, rows, scale, allow_amx)
    return out, reference(q, k, v, rows, scale), rows


def assert_matches(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> None:
    owned = torch.zeros(out.shape[0], dtype=torch.bool)
    for begin, end in rows.tolist():
        owned[begin:end] = True
    assert bool((out[~owned] == 7.0).all()), "the kernel wrote rows no request owns"
    got, want = out[owned].double(), ref[owned]
    if out.dtype == torch.bfloat16:
        # bf16 in, float32 softmax and sums, one rounding to bf16 at the end:
        # within half a bf16 ulp of the exact result, plus the sums' error.
        # That error is 1e-5, not float32's 1e-6: with AMX the probabilities
        # are multiplied as two bf16 parts (~17 bits), see P_PARTS in the C
        # source (values here are of order 1). SDPA rounds them to 8 bits.
        bound = torch.finfo(torch.bfloat16).eps / 2 * want.abs() + 1e-5
        assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_float64_causal_reference(head_size: int, group: int, dtype: torch.dtype) -> None:
    out, ref, rows = run_kernel(LENGTHS, 2 * group, 2, head_size, dtype)
    assert_matches(out, ref, rows)


@pytest.mark.parametrize("head_size", [64, 80])
@pytest.mark.parametrize("group", [1, 3])
def test_bfloat16_without_amx_matches_the_reference(head_size: int, group: int) -> None:
    """The AVX512-BF16 dot-product path (CPUs without AMX) on the same cases."""
    out, ref, rows = run_kernel(LENGTHS, 2 * group, 2, head_size, torch.bfloat16, allow_amx=False)
    assert_matches(out, ref, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_over_several_softmax_chunks(dtype: torch.dtype) -> None:
    """1,100 rows: three 512-key chunks, the running max and sum rescaled twice."""
    out, ref, rows = run_kernel([1100, 31], 12, 4, 64, dtype)
    assert_matches(out, ref, rows)


def test_a_call_split_over_threads_is_bit_identical() -> None:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _, _ = run_kernel(LENGTHS * 2, 12, 4, 64, torch.bfloat16)
        torch.set_num_threads(3)
        three, _, _ = run_kernel(LENGTHS * 2, 12, 4, 64, torch.bfloat16)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, three)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_torch_native_runs_every_fresh_prefill_in_one_call_and_matches_sdpa(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, atol: float
) -> None:
    """A mixed batch (decodes, a chunk with cached context, three fresh
    prefills): one kernel call per layer for the fresh prefills, the same
    output as the SDPA path (bf16: both are within a rounding of the exact
    result, so within two of each other)."""
    calls = []
    kernel = cpu_prefill_kernel.prefill_attention
    monkeypatch.setattr(cpu_prefill_kernel, "prefill_attention",
                        lambda *args, **kwargs: calls.append(args[4].tolist()) or kernel(*args, **kwargs))
    case = build_case([37, 20, 50, 9, 33, 70], [12, 20, 1, 9, 1, 70], num_heads=12, num_kv_heads=4, head_size=64,
                      dtype=dtype)
    with_kernel, cache_with = run_backend(TorchNativeBackend, case)
    # rows of the flattened batch: 12 (chunk), 20, 1 (decode), 9, 1, 70
    assert calls == [[[12, 32], [33, 42], [43, 113]]]
    monkeypatch.setattr(cpu_prefill_kernel, "supports", lambda *args: False)
    without, cache_without = run_backend(TorchNativeBackend, case)
    assert len(calls) == 1
    torch.testing.assert_close(with_kernel, without, atol=atol, rtol=atol)
    torch.testing.assert_close(cache_with, cache_without, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, 3.0), (8, None)])
def test_soft_cap_and_short_windows_keep_sdpa(monkeypatch: pytest.MonkeyPatch, sliding_window: int | None,
                                              soft_cap: float | None) -> None:
    calls = []
    monkeypatch.setattr(cpu_prefill_kernel, "prefill_attention", lambda *args: calls.append(1))
    case = build_case([20, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32, sliding_window=sliding_window,
                      soft_cap=soft_cap)
    run_backend(TorchNativeBackend, case)
    assert calls == []


def test_supports_names_what_the_kernel_runs() -> None:
    q = torch.zeros(30, 4, 64)
    k = v = torch.zeros(30, 2, 64)
    assert cpu_prefill_kernel.supports(q, k, v, 4, 2, None, None, 30)
    assert cpu_prefill_kernel.supports(q, k, v, 4, 2, 30, None, 30)  # a window no shorter than the prompt
    assert not cpu_prefill_kernel.supports(q, k, v, 4, 2, 29, None, 30)
    assert not cpu_prefill_kernel.supports(q, k, v, 4, 2, None, 5.0, 30)
    assert not cpu_prefill_kernel.supports(q.half(), k.half(), v.half(), 4, 2, None, None, 30)
    odd = torch.zeros(30, 4, 24)
    assert not cpu_prefill_kernel.supports(odd, odd[:, :2], odd[:, :2], 4, 2, None, None, 30)
    # heads not contiguous within a row
    assert not cpu_prefill_kernel.supports(q.transpose(0, 1), k, v, 4, 2, None, None, 30)


def test_fp8_caches_keep_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache's fresh prefills attend over the quantized keys (dequantized, then SDPA)."""
    calls = []
    monkeypatch.setattr(cpu_prefill_kernel, "prefill_attention", lambda *args: calls.append(1))
    case = build_case([20, 9], [20, 9], num_heads=4, num_kv_heads=2, head_size=32,
                      kv_cache_dtype=torch.float8_e4m3fn)
    run_backend(TorchNativeBackend, case)
    assert calls == []


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_prefill_kernel.ENV_SWITCH, "0")
    cpu_prefill_kernel.load.cache_clear()
    try:
        assert cpu_prefill_kernel.load() is None
        q = torch.zeros(30, 4, 64)
        assert not cpu_prefill_kernel.supports(q, q[:, :2], q[:, :2], 4, 2, None, None, 30)
        calls = []
        monkeypatch.setattr(cpu_prefill_kernel, "prefill_attention", lambda *args: calls.append(1))
        run_backend(TorchNativeBackend, build_case([20, 9], [20, 9], head_size=64))
        assert calls == []
    finally:
        cpu_prefill_kernel.load.cache_clear()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march levels")
def test_a_build_for_avx512_without_bf16_or_amx_matches_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """skylake-avx512: bf16 keys converted to float32 and FMAs, no AMX."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():
        pytest.skip("this CPU cannot run -march=skylake-avx512 code")
    library = build_for_march(cpu_prefill_kernel.SOURCE, cpu_prefill_kernel.CFLAGS, "skylake-avx512", tmp_path)
    library.prefill_attention.restype = ctypes.c_int
    library.prefill_attention.argtypes = cpu_prefill_kernel._ARGTYPES
    monkeypatch.setattr(cpu_prefill_kernel, "load", lambda: library)
    for dtype in (torch.float32, torch.bfloat16):
        for head_size, group in ((64, 3), (80, 1), (32, 8)):
            out, ref, rows = run_kernel(LENGTHS, 2 * group, 2, head_size, dtype)
            assert_matches(out, ref, rows)
