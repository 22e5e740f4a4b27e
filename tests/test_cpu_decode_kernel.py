"""The CPU paged-decode kernel (attention_backends/csrc/paged_decode.c)
against a float64 per-request reference in plain torch.

Every case's cache holds NaN in the slots no request owns and its blocks are
shuffled (helpers/attention_case.py), so reading a wrong slot shows. The
lengths are not multiples of the kernel's 16-token chunks, and head sizes
not multiples of its 16- and 32-lane vectors, so the masked tails run. The
kernel built here is the AVX-512 one where this CPU has it; the portable C
loop (and AVX-512 without BF16) are built with an older -march at the end.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

import pytest
import torch
from helpers.attention_case import build_case, run_backend
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags

from pagedllm.attention_backends import cpu_decode_kernel, torch_native
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.platforms.cpu import kernel_build as cpu_kernel_build

pytestmark = NO_COMPILER


def reference(case_requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float,
              sliding_window: int | None, soft_cap: float | None, query_len: int = 1) -> torch.Tensor:
    """[B * q, H, D] float64: each request's last q positions, each over its
    keys up to and including its own."""
    outs = []
    for query, keys, values in case_requests:
        num_heads, num_kv_heads = query.shape[1], keys.shape[1]
        for row in range(query_len):
            seq_len = keys.shape[0] - (query_len - 1 - row)
            k = keys[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, D]
            v = values[:seq_len].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.einsum("hd,shd->hs", query[row - query_len].double(), k) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            if sliding_window is not None:
                scores[:, : max(0, seq_len - sliding_window)] = float("-inf")
            outs.append(torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(outs)


def run_kernel(seq_lens: list[int], dtype: torch.dtype, query_len: int = 1,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output [B * q, H, D], float64 reference) for q query tokens per
    request (1: a decode step; more: a verify step), their keys and values
    written by the kernel itself."""
    sliding_window, soft_cap = kwargs.get("sliding_window"), kwargs.get("soft_cap")
    case = build_case(seq_lens, [query_len] * len(seq_lens), dtype=dtype, **kwargs)
    head_size, block_size = case.head_size, case.block_size
    key_cache = case.kv_cache[0].view(-1, case.num_kv_heads, head_size)
    value_cache = case.kv_cache[1].view(-1, case.num_kv_heads, head_size)
    out = cpu_decode_kernel.paged_decode(
        case.query, key_cache, value_cache, block_size, case.metadata.block_table, case.metadata.seq_lens_cpu,
        head_size**-0.5, sliding_window, soft_cap, (case.key, case.value, case.metadata.slot_mapping),
        query_len=query_len,
    )
    return out, reference(case.requests, head_size**-0.5, sliding_window, soft_cap, query_len)


SEQ_LENS = [1, 17, 40, 16, 95, 3, 64]


HEAD_SIZES = [64, 128, 80, 32, 16]  # the two compiled-in sizes, then the generic loop with and without tails
GROUPS = [(12, 4), (4, 4), (16, 2)]  # query heads per KV head: 3, 1, 8


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS)
def test_float32_matches_the_reference(head_size: int, num_heads: int, num_kv_heads: int) -> None:
    out, ref = run_kernel(SEQ_LENS, torch.float32, head_size=head_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS)
def test_bfloat16_is_the_float32_result_rounded_once(head_size: int, num_heads: int, num_kv_heads: int) -> None:
    """bf16 in, float32 softmax and sums, one rounding to bf16 at the end:
    within half a bf16 ulp of the exact result, plus float32 summation error."""
    out, ref = run_kernel(SEQ_LENS, torch.bfloat16, head_size=head_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads)
    assert_rounded_once(out, ref)


# Head sizes up to the limit, 4-head tiles of a group with a remainder (10/2,
# 7/7), sizes below one vector (8) and past one 64-dim tile (96, 200).
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(512, 64, 1), (96, 10, 2), (8, 6, 3), (200, 7, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unusual_shapes(head_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    out, ref = run_kernel([1, 33, 70, 5], dtype, head_size=head_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads)
    if dtype == torch.bfloat16:
        assert_rounded_once(out, ref)
    else:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def assert_rounded_once(out: torch.Tensor, ref: torch.Tensor) -> None:
    bound = torch.finfo(torch.bfloat16).eps / 2 * ref.abs() + 1e-6
    assert bool(((out.double() - ref).abs() <= bound).all()), float(((out.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("query_len", [2, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,window,cap",
                         [(12, 4, None, None), (4, 4, 20, 3.0), (16, 2, None, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_attend_causally_in_one_call(
    query_len: int, num_heads: int, num_kv_heads: int, window: int | None, cap: float | None, dtype: torch.dtype
) -> None:
    """q rows per request (a verify step): each attends over its context up
    to its own position, the rows' new keys written first."""
    out, ref = run_kernel([5, 17, 40, 16, 95, 64], dtype, query_len, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, sliding_window=window, soft_cap=cap)
    if dtype == torch.bfloat16:
        assert_rounded_once(out, ref)
    else:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_query_rows_must_be_whole_requests() -> None:
    case = build_case([9, 12], [2, 2])
    caches = [case.kv_cache[i].view(-1, case.num_kv_heads, case.head_size) for i in (0, 1)]
    with pytest.raises(ValueError, match="4 query rows for 2 requests of 3"):
        cpu_decode_kernel.paged_decode(case.query, *caches, case.block_size, case.metadata.block_table,
                                       case.metadata.seq_lens_cpu, 0.125, None, None, query_len=3)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])  # a 16-token chunk spans blocks, or part of one
def test_block_sizes(block_size: int) -> None:
    out, ref = run_kernel(SEQ_LENS, torch.float32, block_size=block_size)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_bfloat16_block_sizes(block_size: int) -> None:
    out, ref = run_kernel(SEQ_LENS, torch.bfloat16, block_size=block_size, head_size=64, num_heads=12,
                          num_kv_heads=4)
    assert_rounded_once(out, ref)


@pytest.mark.parametrize("sliding_window", [1, 5, 16, 200])
def test_sliding_window_reads_only_the_last_positions(sliding_window: int) -> None:
    out, ref = run_kernel(SEQ_LENS, torch.float32, sliding_window=sliding_window)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_logits_soft_cap() -> None:
    out, ref = run_kernel(SEQ_LENS, torch.float32, soft_cap=2.0, sliding_window=30)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("head_size", [32, 128, 80])
@pytest.mark.parametrize("sliding_window", [30, 17, 1])  # windows that start inside a block and a chunk
def test_bfloat16_soft_cap_and_sliding_window(head_size: int, sliding_window: int) -> None:
    out, ref = run_kernel(SEQ_LENS, torch.bfloat16, soft_cap=2.0, sliding_window=sliding_window,
                          head_size=head_size, num_heads=6, num_kv_heads=2)
    assert_rounded_once(out, ref)


def test_a_batch_split_over_threads_is_bit_identical() -> None:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_kernel(SEQ_LENS * 3, torch.bfloat16, num_heads=12, num_kv_heads=4, head_size=64)
        torch.set_num_threads(3)
        three, _ = run_kernel(SEQ_LENS * 3, torch.bfloat16, num_heads=12, num_kv_heads=4, head_size=64)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, three)


def test_torch_native_decodes_go_through_the_kernel_and_match_the_gather_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixed batch: its decode rows take the kernel, the rest SDPA; switching
    the kernel off gives the same output up to float32 rounding."""
    calls = []
    kernel = cpu_decode_kernel.paged_decode
    monkeypatch.setattr(cpu_decode_kernel, "paged_decode",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    case = build_case([37, 20, 50, 9, 33], [12, 20, 1, 1, 1], num_heads=12, num_kv_heads=4, head_size=64)
    with_kernel, _ = run_backend(TorchNativeBackend, case)
    # one call for all decodes: the gather path's length split (contexts 9 vs 33
    # and 50) is not made where the kernel runs
    assert calls == [1]
    monkeypatch.setattr(cpu_decode_kernel, "supports", lambda *args: False)
    without, _ = run_backend(TorchNativeBackend, case)
    assert calls == [1]
    torch.testing.assert_close(with_kernel, without, atol=2e-6, rtol=2e-6)


def test_without_a_compiler_load_returns_none_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    cpu_decode_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=cpu_kernel_build.__name__):
            assert cpu_decode_kernel.load() is None
        assert "kernel unavailable" in caplog.text
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-built library left behind
    finally:
        cpu_decode_kernel.load.cache_clear()


def test_the_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_decode_kernel.ENV_SWITCH, "0")
    cpu_decode_kernel.load.cache_clear()
    try:
        assert cpu_decode_kernel.load() is None
        query, cache = torch.zeros(1, 4, 16), torch.zeros(16, 2, 16)
        assert not cpu_decode_kernel.supports(query, cache, 4, 2)
    finally:
        cpu_decode_kernel.load.cache_clear()


def _build_for(march: str, directory: Path) -> ctypes.CDLL:
    """The kernel compiled for an older -march than this CPU's."""
    library = build_for_march(cpu_decode_kernel.SOURCE, cpu_decode_kernel.CFLAGS, march, directory)
    library.paged_decode.restype = ctypes.c_int
    library.paged_decode.argtypes = cpu_decode_kernel._ARGTYPES
    return library


# x86-64-v3: AVX2, the portable C loop; skylake-avx512: the AVX-512 kernel
# with float32 products for bf16 (no AVX512-BF16 dot product).
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 -march levels")
@pytest.mark.parametrize("march,needs", [("x86-64-v3", {"avx2", "fma"}),
                                         ("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builds_for_older_cpus_match_the_reference(
    march: str, needs: set[str], dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march} code")
    library = _build_for(march, tmp_path)
    monkeypatch.setattr(cpu_decode_kernel, "load", lambda: library)
    for head_size, num_heads, num_kv_heads, window, cap in [(64, 12, 4, None, None), (80, 8, 1, 30, 2.0),
                                                            (32, 4, 4, None, None), (128, 6, 2, 17, None)]:
        for seq_lens, query_len in [(SEQ_LENS, 1), ([5, 40, 17], 4)]:
            out, ref = run_kernel(seq_lens, dtype, query_len, head_size=head_size, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads, sliding_window=window, soft_cap=cap)
            if dtype == torch.bfloat16:
                assert_rounded_once(out, ref)
            else:
                torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_a_torch_native_layer_starts_the_build_in_the_background_and_loads_build_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A new machine's first build overlaps the model's loading: the first
    torch_native layer starts it on a thread; a load racing it waits for that
    build instead of compiling a second time."""
    import threading

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    builds: list[Path] = []
    real_build = cpu_kernel_build.build
    monkeypatch.setattr(cpu_kernel_build, "build", lambda *args: builds.append(args[-1]) or real_build(*args))
    cpu_decode_kernel.load.cache_clear()
    monkeypatch.setattr(cpu_kernel_build, "_prebuilt", set())
    try:
        TorchNativeBackend.get_impl_cls()(4, 64, 0.125, 2)
        racing = cpu_decode_kernel.load()  # while the background build may still run
        for thread in threading.enumerate():
            if thread.name == "kernel-prebuild":
                thread.join(timeout=120)
        assert racing is not None
        decode_builds = [path for path in builds if path.name.startswith("paged_decode-")]
        assert len(decode_builds) == 1 and decode_builds[0].parent == tmp_path / "kernels"
        assert decode_builds[0].exists()
    finally:
        cpu_decode_kernel.load.cache_clear()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (torch.equal says NaN != NaN)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_kv_rows_are_written_to_their_slots_before_attending(dtype: torch.dtype) -> None:
    """paged_decode(new_kv=...) leaves the caches as index_copy_ of the new
    rows would, and its output is bit-identical to writing first, then
    calling the kernel."""
    case = build_case(SEQ_LENS, [1] * len(SEQ_LENS), dtype=dtype, num_heads=12, num_kv_heads=4, head_size=64)
    slots = case.metadata.slot_mapping.long()
    caches = []
    for fused in (False, True):
        kv_cache = case.kv_cache.clone()
        key_cache, value_cache = (kv_cache[i].view(-1, case.num_kv_heads, case.head_size) for i in (0, 1))
        if not fused:
            key_cache.index_copy_(0, slots, case.key)
            value_cache.index_copy_(0, slots, case.value)
        out = cpu_decode_kernel.paged_decode(
            case.query, key_cache, value_cache, case.block_size, case.metadata.block_table,
            case.metadata.seq_lens_cpu, 0.125, None, None, (case.key, case.value, slots) if fused else None,
        )
        caches.append((out, kv_cache))
    (unfused_out, unfused_cache), (fused_out, fused_cache) = caches
    assert same_bits(fused_cache, unfused_cache)  # the unowned slots hold NaN
    assert not same_bits(fused_cache, case.kv_cache)  # the rows were new
    assert torch.equal(fused_out, unfused_out)


def test_new_kv_rows_must_have_contiguous_heads_and_int64_slots() -> None:
    case = build_case([5, 9], [1, 1], num_heads=4, num_kv_heads=2, head_size=32)
    key_cache = case.kv_cache[0].view(-1, 2, 32)
    slots = case.metadata.slot_mapping.long()
    assert cpu_decode_kernel.takes_new_kv(case.key, case.value, slots, key_cache)
    assert not cpu_decode_kernel.takes_new_kv(case.key, case.value, slots.int(), key_cache)
    strided = torch.zeros(2, 32, 2)[..., 0].unsqueeze(1).expand(2, 2, 32)  # head dims 2 elements apart
    assert not cpu_decode_kernel.takes_new_kv(strided, case.value, slots, key_cache)
    assert not cpu_decode_kernel.takes_new_kv(case.key[:1], case.value, slots, key_cache)
    with pytest.raises(ValueError, match="new_kv"):
        cpu_decode_kernel.paged_decode(case.query, key_cache, case.kv_cache[1].view(-1, 2, 32), case.block_size,
                                       case.metadata.block_table, case.metadata.seq_lens_cpu, 0.1, None, None,
                                       (case.key, case.value, slots.int()))


def test_a_decode_only_batch_writes_its_kv_in_the_kernel_and_matches_the_separate_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch_native hands a whole batch of decodes' new K/V to the kernel (no
    write_kv); output and cache are bit-identical to writing them first."""
    case = build_case([37, 20, 50, 9, 33], [1] * 5, dtype=torch.bfloat16, num_heads=12, num_kv_heads=4,
                      head_size=64)
    writes = []
    real_write_kv = torch_native.write_kv
    monkeypatch.setattr(torch_native, "write_kv", lambda *args: writes.append(1) or real_write_kv(*args))
    fused_out, fused_cache = run_backend(TorchNativeBackend, case)
    assert writes == []
    monkeypatch.setattr(cpu_decode_kernel, "takes_new_kv", lambda *args: False)
    separate_out, separate_cache = run_backend(TorchNativeBackend, case)
    assert writes == [1, 1]
    assert torch.equal(fused_out, separate_out) and same_bits(fused_cache, separate_cache)


def test_a_new_kv_row_with_slot_minus_one_writes_nothing() -> None:
    """A decode graph's padding rows carry slot -1: the kernel leaves the
    cache as it was for them (no write before the cache's start) and still
    writes the other rows."""
    case = build_case([5, 9, 14], [1, 1, 1], num_heads=4, num_kv_heads=2, head_size=32)
    slots = case.metadata.slot_mapping.long().clone()
    slots[1] = -1
    kv_cache = case.kv_cache.clone()
    key_cache, value_cache = (kv_cache[i].view(-1, 2, 32) for i in (0, 1))
    cpu_decode_kernel.paged_decode(case.query, key_cache, value_cache, case.block_size, case.metadata.block_table,
                                   case.metadata.seq_lens_cpu, 0.1, None, None, (case.key, case.value, slots))
    expected = case.kv_cache.clone()
    kept = slots >= 0
    expected[0].view(-1, 2, 32).index_copy_(0, slots[kept], case.key[kept])
    expected[1].view(-1, 2, 32).index_copy_(0, slots[kept], case.value[kept])
    assert same_bits(kv_cache, expected)
