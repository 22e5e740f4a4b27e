"""The Triton backend's kernels against the torch_native backend, on CPU
through the Triton interpreter (TRITON_INTERPRET=1 is set by conftest before
any kernel is defined). Shapes stay small: the interpreter runs every
program in Python. benchmarks/gpu_check.sh runs this file compiled on a GPU
(TRITON_INTERPRET=0, PAGEDLLM_TEST_DEVICE=cuda)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.attention_case import DEVICE, build_case, run_backend

from pagedllm import LLM, SamplingParams
from pagedllm.attention_backends.torch_native import TorchNativeBackend

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and DEVICE.type != "cuda",
    reason="needs the Triton interpreter or a CUDA device",
)

triton_backend = pytest.importorskip("pagedllm.attention_backends.triton")
TritonBackend = triton_backend.TritonBackend

# A prefill chunk with cached context, a fresh prefill, and decodes.
MIXED = dict(seq_lens=[37, 20, 50, 9, 33], query_lens=[12, 20, 1, 1, 1])
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def assert_same_as_torch_native(**case_args: object) -> None:
    case = build_case(**case_args)  # type: ignore[arg-type]
    expected, expected_cache = run_backend(TorchNativeBackend, case)
    out, cache = run_backend(TritonBackend, case)
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[case.query.dtype])
    # The cache-write kernel stored exactly what index_copy_ stored (NaN = never written).
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_equals_torch_native(dtype: torch.dtype, block_size: int) -> None:
    assert_same_as_torch_native(**MIXED, dtype=dtype, block_size=block_size)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_gqa_ratios_1_2_4(num_heads: int, num_kv_heads: int) -> None:
    assert_same_as_torch_native(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_gqa_ratio_that_is_not_a_power_of_two() -> None:
    # 3 query heads per KV head: a 16-row program holds 5 tokens and one unused row.
    assert_same_as_torch_native(**MIXED, num_heads=6, num_kv_heads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_odd_head_size_80_is_padded_and_masked(dtype: torch.dtype) -> None:
    assert_same_as_torch_native(seq_lens=[21, 18, 40], query_lens=[21, 3, 1], head_size=80, num_heads=2,
                                num_kv_heads=1, dtype=dtype)


def test_sliding_window() -> None:
    assert_same_as_torch_native(**MIXED, sliding_window=8)


def test_sliding_window_longer_than_a_tile_skips_whole_tiles() -> None:
    assert_same_as_torch_native(seq_lens=[70, 66], query_lens=[30, 1], sliding_window=20)


def test_logit_soft_cap() -> None:
    assert_same_as_torch_native(**MIXED, soft_cap=2.0)


def test_pure_decode_and_pure_prefill_batches() -> None:
    assert_same_as_torch_native(seq_lens=[5, 17, 40, 1], query_lens=[1, 1, 1, 1])
    assert_same_as_torch_native(seq_lens=[7, 30, 3], query_lens=[7, 30, 3], dtype=torch.float16)


# ------------------------------------------------------------- fp8 KV cache


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_an_fp8_cache_is_written_and_read_as_torch_native_does(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The kernel loads fp8 tiles and converts them to the query's dtype;
    the new K/V are stored bit for bit as torch_native stores them (which
    tests/test_kv_cache_dtype.py checks against a plain-torch reference)."""
    case = build_case(**MIXED, dtype=dtype, kv_cache_dtype=cache_dtype)  # type: ignore[arg-type]
    expected, expected_cache = run_backend(TorchNativeBackend, case)
    out, cache = run_backend(TritonBackend, case)
    assert out.dtype == dtype and cache.dtype == cache_dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))


def test_an_fp8_cache_in_the_split_kv_decode_path() -> None:
    from pagedllm.attention_backends.triton.unified_attention import unified_attention

    case = build_case(seq_lens=[40, 7], query_lens=[1, 1], dtype=torch.float16, seed=4,
                      kv_cache_dtype=torch.float8_e4m3fn)
    expected, cache = run_backend(TorchNativeBackend, case)
    out = torch.zeros_like(case.query)
    meta = case.metadata
    unified_attention(
        out, case.query, cache[0], cache[1], meta.block_table, meta.seq_lens, meta.query_start_loc,
        num_reqs=meta.num_reqs, max_query_len=1, scale=case.head_size**-0.5, num_segments=3,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float16])


# ------------------------------------------------------------- split-KV


@pytest.mark.parametrize("head_size", [32, 48, 72, 112, 160, 192])
def test_every_head_size_up_to_256_is_padded_and_masked(head_size: int) -> None:
    """What the registration declares (max_head_size=256): sizes below the
    minimum tile and between powers of two, in a mixed batch and in the
    split-KV decode path."""
    from pagedllm.attention_backends.triton.unified_attention import unified_attention

    assert_same_as_torch_native(seq_lens=[21, 18, 40], query_lens=[21, 3, 1], head_size=head_size, num_heads=2,
                                num_kv_heads=1, dtype=torch.float32)
    case = build_case(seq_lens=[40, 7], query_lens=[1, 1], head_size=head_size, num_heads=2, num_kv_heads=1,
                      dtype=torch.float32, seed=4)
    expected, cache = run_backend(TorchNativeBackend, case)
    out = torch.zeros_like(case.query)
    meta = case.metadata
    unified_attention(
        out, case.query, cache[0], cache[1], meta.block_table, meta.seq_lens, meta.query_start_loc,
        num_reqs=meta.num_reqs, max_query_len=1, scale=head_size**-0.5, num_segments=3,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_the_registration_declares_what_the_kernel_serves() -> None:
    from pagedllm.attention_backends.selector import check_backend
    from pagedllm.platforms.cpu import CpuPlatform
    from pagedllm.plugins import get_plugin_manager

    registration = get_plugin_manager().attention_backends.get("triton")
    platform = CpuPlatform()

    def reasons(head_size: int) -> list[str]:
        return [reason for reason in check_backend(registration, platform, head_size=head_size,
                                                   dtype=torch.float32, block_size=16) if "head size" in reason]

    assert all(reasons(size) == [] for size in (32, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256))
    assert reasons(320) == ["head size 320 > 256 maximum"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("num_segments", [2, 3, 5])
def test_split_kv_decode_equals_one_segment(dtype: torch.dtype, num_segments: int) -> None:
    from pagedllm.attention_backends.triton.unified_attention import unified_attention

    case = build_case(seq_lens=[90, 33, 7], query_lens=[1, 1, 1], dtype=dtype, seed=3)
    expected, cache = run_backend(TorchNativeBackend, case)  # `cache` now holds the step's keys too
    out = torch.zeros_like(case.query)
    meta = case.metadata
    unified_attention(
        out, case.query, cache[0], cache[1], meta.block_table, meta.seq_lens, meta.query_start_loc,
        num_reqs=meta.num_reqs, max_query_len=1, scale=case.head_size**-0.5, num_segments=num_segments,
    )
    # 7 keys in 5 segments: some segments are empty and must weigh nothing.
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_split_kv_with_sliding_window() -> None:
    from pagedllm.attention_backends.triton.unified_attention import unified_attention

    case = build_case(seq_lens=[90, 40], query_lens=[1, 1], sliding_window=24, seed=4)
    expected, cache = run_backend(TorchNativeBackend, case)
    out = torch.zeros_like(case.query)
    meta = case.metadata
    unified_attention(
        out, case.query, cache[0], cache[1], meta.block_table, meta.seq_lens, meta.query_start_loc,
        num_reqs=2, max_query_len=1, scale=case.head_size**-0.5, sliding_window=24, num_segments=3,
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_backend_takes_the_split_path_for_long_decodes_at_small_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.attention_backends.triton import backend

    monkeypatch.setattr(backend, "SPLIT_KV_MIN_SEQ_LEN", 64)
    monkeypatch.setattr(backend, "SPLIT_KV_KEYS_PER_SEGMENT", 32)
    case = build_case(seq_lens=[100, 70], query_lens=[1, 1])
    assert TritonBackend.build_metadata(case.metadata, case.block_size).num_segments == 4
    assert_same_as_torch_native(seq_lens=[100, 70], query_lens=[1, 1])
    # Prefill rows never split; nor do large batches.
    assert TritonBackend.build_metadata(build_case(**MIXED).metadata, 16).num_segments == 1
    monkeypatch.setattr(backend, "SPLIT_KV_MAX_REQS", 1)
    assert TritonBackend.build_metadata(case.metadata, case.block_size).num_segments == 1


def test_num_segments_heuristic() -> None:
    from pagedllm.attention_backends.triton.backend import MAX_NUM_SEGMENTS, choose_num_segments

    assert choose_num_segments(num_reqs=1, max_query_len=1, max_seq_len=512) == 1
    assert choose_num_segments(num_reqs=1, max_query_len=1, max_seq_len=1024) == 2
    assert choose_num_segments(num_reqs=1, max_query_len=1, max_seq_len=3000) == 6
    assert choose_num_segments(num_reqs=1, max_query_len=1, max_seq_len=100_000) == MAX_NUM_SEGMENTS
    assert choose_num_segments(num_reqs=1, max_query_len=2, max_seq_len=100_000) == 1
    assert choose_num_segments(num_reqs=64, max_query_len=1, max_seq_len=100_000) == 1


# ---------------------------------------------------------- cache write


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_cache_write_kernel_skips_slot_minus_one(dtype: torch.dtype) -> None:
    from pagedllm.attention_backends.triton.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 3, 80
    key = torch.randn(7, num_kv_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(7, num_kv_heads, head_size, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([17, -1, 0, 95, -1, 40, 41], dtype=torch.int64, device=DEVICE)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
    value_cache = key_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)

    expected_k = torch.full_like(key_cache, float("nan")).view(-1, num_kv_heads, head_size)
    expected_v = expected_k.clone()
    written = slots >= 0
    expected_k[slots[written]] = key[written]
    expected_v[slots[written]] = value[written]
    torch.testing.assert_close(key_cache.view_as(expected_k), expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache.view_as(expected_v), expected_v, atol=0, rtol=0, equal_nan=True)
    assert int(key_cache.isnan().any(dim=(-1, -2)).logical_not().sum()) == int(written.sum())


def test_cache_write_reads_strided_inputs() -> None:
    # Keys sliced out of a fused QKV projection are not contiguous across heads.
    from pagedllm.attention_backends.triton.reshape_and_cache import reshape_and_cache

    qkv = torch.randn(5, 3, 2, 16, device=DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    key_cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    value_cache = torch.zeros(2, 16, 2, 16, device=DEVICE)
    slots = torch.tensor([3, 4, 5, 30, 31], device=DEVICE)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, 16)[slots], key)
    assert torch.equal(value_cache.view(-1, 2, 16)[slots], value)


# ------------------------------------------------------------ end to end


PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n", "# a"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tiny_model_greedy_tokens_with_triton_forced_equal_torch_native(kv_cache_dtype: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("cpu", "triton"):  # cpu: the backend once named torch_native
        # A small token budget makes steps that mix prefill chunks with decodes.
        llm = LLM(model="tiny", dtype="float32", attention_backend=backend, num_kv_blocks=32,
                  max_num_batched_tokens=16, enable_chunked_prefill=True, kv_cache_dtype=kv_cache_dtype)
        assert llm.engine_core.ready.attention_backend == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["triton"] == outputs["cpu"]
    assert all(len(tokens) == 12 for tokens in outputs["triton"])
