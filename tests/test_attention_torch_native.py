"""torch_native paged attention against a plain per-request torch reference."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_case import build_case, run_backend

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.torch_native import TorchNativeBackend, build_batch_plan, split_by_length


def reference_attention(
    query: torch.Tensor,  # [q_len, H, D]
    keys: torch.Tensor,  # [seq_len, Hkv, D]
    values: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    out = torch.empty(q_len, num_heads, query.shape[2])
    for i in range(q_len):
        pos = seq_len - q_len + i
        for h in range(num_heads):
            scores = (k[:, h] @ query[i, h].float()) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            allowed = torch.arange(seq_len) <= pos
            if sliding_window is not None:
                allowed &= torch.arange(seq_len) > pos - sliding_window
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[i, h] = torch.softmax(scores, dim=0) @ v[:, h]
    return out


def run_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (backend output, reference output), both [T, H, D] float32."""
    case = build_case(
        seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, dtype=dtype, sliding_window=sliding_window, soft_cap=soft_cap, seed=seed,
    )
    out, _ = run_backend(TorchNativeBackend, case)
    refs = [
        reference_attention(query, keys, values, head_size**-0.5, sliding_window, soft_cap)
        for query, keys, values in case.requests
    ]
    return out.float().cpu(), torch.cat(refs)


# A prefill chunk with cached context, a fresh prefill, and decodes.
MIXED = dict(seq_lens=[37, 20, 50, 9, 33], query_lens=[12, 20, 1, 1, 1])


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference_fp32(block_size: int) -> None:
    out, ref = run_case(**MIXED, block_size=block_size)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_pure_decode_batch_matches_reference() -> None:
    out, ref = run_case(seq_lens=[5, 17, 40, 1], query_lens=[1, 1, 1, 1])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_pure_prefill_batch_matches_reference() -> None:
    out, ref = run_case(seq_lens=[7, 30, 3], query_lens=[7, 30, 3])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 1), (6, 3), (4, 4)])
def test_gqa_head_groups(num_heads: int, num_kv_heads: int) -> None:
    out, ref = run_case(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_attends_only_to_recent_positions() -> None:
    out, ref = run_case(**MIXED, sliding_window=8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    full, _ = run_case(**MIXED)
    assert not torch.allclose(out, full, atol=1e-3)


def test_logits_soft_cap() -> None:
    out, ref = run_case(**MIXED, soft_cap=2.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision(dtype: torch.dtype, atol: float) -> None:
    out, ref = run_case(**MIXED, dtype=dtype)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    out, ref = run_case(**MIXED, dtype=dtype, soft_cap=5.0)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


def test_kv_written_at_slot_mapping_and_minus_one_skipped() -> None:
    num_blocks, block_size, num_kv_heads, head_size = 4, 4, 2, 8
    kv_cache = torch.zeros(TorchNativeBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    # One request of 3 tokens in block 2; the middle token's slot is -1.
    slot_mapping = torch.tensor([8, -1, 10])
    key = torch.randn(3, num_kv_heads, head_size)
    value = torch.randn(3, num_kv_heads, head_size)
    query = torch.randn(3, 4, head_size)
    query_start_loc = torch.tensor([0, 3], dtype=torch.int32)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    metadata = AttentionMetadata(3, 1, 3, 3, query_start_loc, seq_lens, torch.tensor([[2]], dtype=torch.int32),
                                 slot_mapping, query_start_loc.clone(), seq_lens.clone())
    impl = TorchNativeBackend.get_impl_cls()(4, head_size, 1.0, num_kv_heads)
    impl.forward(query, key, value, kv_cache, metadata)

    expected = torch.zeros_like(kv_cache)
    expected[0, 2, 0], expected[1, 2, 0] = key[0], value[0]
    expected[0, 2, 2], expected[1, 2, 2] = key[2], value[2]
    assert torch.equal(kv_cache, expected)


def test_batch_plan_splits_decodes_from_prefills() -> None:
    query_start_loc = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
    seq_lens = torch.tensor([8, 6, 9], dtype=torch.int32)  # decodes of close lengths: one group
    metadata = AttentionMetadata(7, 3, 5, 9, query_start_loc, seq_lens, torch.tensor([[0, 1], [2, 3], [4, 5]]),
                                 torch.arange(7), query_start_loc.clone(), seq_lens.clone())
    plan = build_batch_plan(metadata, block_size=8)
    decodes, prefills = plan.groups
    assert decodes.token_rows.tolist() == [0, 6] and decodes.padded_rows is None
    assert prefills.token_rows.tolist() == [1, 2, 3, 4, 5]
    assert prefills.query_pos.tolist() == [[1, 2, 3, 4, 5]]
    assert plan.fresh_prefill_rows == []
    # Request 2 (decode, seq_len 9): keys at positions 0..7 in block 4, 8 in block 5.
    assert decodes.key_slots[1].tolist() == [32, 33, 34, 35, 36, 37, 38, 39, 40]


def test_fresh_prefills_are_planned_per_request_without_cache_reads() -> None:
    # Requests: decode, fresh prefill (5 of 5), chunk with context (2 of 6), fresh prefill (3 of 3).
    query_start_loc = torch.tensor([0, 1, 6, 8, 11], dtype=torch.int32)
    seq_lens = torch.tensor([4, 5, 6, 3], dtype=torch.int32)
    metadata = AttentionMetadata(11, 4, 5, 6, query_start_loc, seq_lens, torch.arange(8).view(4, 2),
                                 torch.arange(11), query_start_loc.clone(), seq_lens.clone())
    plan = build_batch_plan(metadata, block_size=8)
    assert plan.fresh_prefill_rows == [(1, 6), (8, 11)]
    decodes, chunks = plan.groups
    assert decodes.token_rows.tolist() == [0] and chunks.token_rows.tolist() == [6, 7]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (4, None), (None, 3.0), (64, None)])
def test_fresh_prefills_beside_decodes_and_chunks_match_reference(
    dtype: torch.dtype, atol: float, sliding_window: int | None, soft_cap: float | None
) -> None:
    out, ref = run_case(seq_lens=[9, 23, 40, 17, 5], query_lens=[1, 23, 7, 17, 5], dtype=dtype,
                        sliding_window=sliding_window, soft_cap=soft_cap, num_heads=6, num_kv_heads=2)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


def test_fresh_prefill_is_bit_identical_to_a_masked_call_over_the_request_alone() -> None:
    """The per-request causal call computes what one masked SDPA call over the
    request's own keys computes, to the bit, in float32 and bfloat16 (the
    padded batch it replaces differs in the last bit: padding changes the
    kernel's blocking)."""
    gen = torch.Generator().manual_seed(3)
    impl = TorchNativeBackend.get_impl_cls()(num_heads=6, head_size=32, scale=32**-0.5, num_kv_heads=2)
    for dtype, atol in ((torch.float32, 0.0), (torch.bfloat16, 0.0)):
        q = torch.randn(37, 6, 32, generator=gen).to(dtype)
        k, v = (torch.randn(37, 2, 32, generator=gen).to(dtype) for _ in range(2))
        fresh = impl._attend_fresh_prefill(q, k, v)
        mask = torch.ones(37, 37, dtype=torch.bool).tril()
        padded = impl._attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
        torch.testing.assert_close(fresh, padded[0].transpose(0, 1), atol=atol, rtol=0)


def test_decodes_of_very_different_lengths_are_split_in_two_groups() -> None:
    req_ids = torch.arange(6)
    seq_lens = torch.tensor([300, 20, 310, 25, 18, 290])
    short, long = split_by_length(req_ids, seq_lens)
    assert short.tolist() == [1, 3, 4] and long.tolist() == [0, 2, 5]
    # 6 x 310 padded keys against 3 x 25 + 3 x 310: more than 25 % saved.
    close = torch.tensor([300, 280, 310, 295, 305, 290])
    assert [ids.tolist() for ids in split_by_length(req_ids, close)] == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "gather"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_split_decode_groups_match_reference(
    dtype: torch.dtype, atol: float, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU decode kernel runs, the decodes stay one group; a layer
    that gathers splits them by length (gather_groups). Both match."""
    if not kernel:
        from pagedllm.attention_backends import cpu_decode_kernel

        monkeypatch.setattr(cpu_decode_kernel, "supports", lambda *args: False)
    seq_lens = [70, 3, 66, 5, 40, 2]
    query_lens = [1, 1, 1, 1, 12, 1]
    case_plan = build_batch_plan(
        AttentionMetadata(17, 6, 12, 70, torch.tensor([0, 1, 2, 3, 4, 16, 17], dtype=torch.int32),
                          torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(6, 5, dtype=torch.int32),
                          torch.arange(17), torch.tensor([0, 1, 2, 3, 4, 16, 17], dtype=torch.int32),
                          torch.tensor(seq_lens, dtype=torch.int32)), block_size=16)
    assert len(case_plan.groups) == 2  # the decodes, the chunk with context
    assert len(case_plan.gather_groups) == 3  # short decodes, long decodes, the chunk
    out, ref = run_case(seq_lens=seq_lens, query_lens=query_lens, dtype=dtype)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


def test_build_metadata_attaches_the_plan_every_layer_reuses() -> None:
    query_start_loc = torch.tensor([0, 2], dtype=torch.int32)
    seq_lens = torch.tensor([2], dtype=torch.int32)
    common = AttentionMetadata(2, 1, 2, 2, query_start_loc, seq_lens, torch.tensor([[1]], dtype=torch.int32),
                               torch.tensor([16, 17]), query_start_loc.clone(), seq_lens.clone())
    built = TorchNativeBackend.build_metadata(common, block_size=16)
    assert built.plan is not None and built.plan.write_slots.tolist() == [16, 17]
    assert built.slot_mapping is common.slot_mapping

    # A forward with the built plan equals one that plans for itself.
    impl = TorchNativeBackend.get_impl_cls()(num_heads=2, head_size=8, scale=0.5, num_kv_heads=1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 8, generator=gen) for n in (2, 1, 1))
    outputs = []
    for metadata in (built, common):
        kv_cache = torch.zeros(TorchNativeBackend.get_kv_cache_shape(4, 16, 1, 8))
        outputs.append(impl.forward(q, k, v, kv_cache, metadata))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (5, None), (None, 3.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 1)])
def test_uniform_query_batches_run_on_the_decode_kernel_and_match_reference(
    dtype: torch.dtype, atol: float, sliding_window: int | None, soft_cap: float | None, num_heads: int,
    num_kv_heads: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verify step (every request scores 1 + k tokens over its context)
    runs on the decode kernel in one call per layer, never on the gather path."""
    from pagedllm.attention_backends import cpu_decode_kernel, torch_native

    if cpu_decode_kernel.load() is None:
        pytest.skip("the CPU decode kernel is not built here")
    calls: list[int] = []
    paged_decode = cpu_decode_kernel.paged_decode
    monkeypatch.setattr(cpu_decode_kernel, "paged_decode", lambda query, *a, **kw: calls.append(query.shape[0])
                        or paged_decode(query, *a, **kw))
    monkeypatch.setattr(torch_native.TorchNativeAttentionImpl, "_attend_group", None)  # no other path may run
    seq_lens, query_lens = [9, 40, 17, 70], [5, 5, 5, 5]
    out, ref = run_case(seq_lens=seq_lens, query_lens=query_lens, dtype=dtype, sliding_window=sliding_window,
                        soft_cap=soft_cap, num_heads=num_heads, num_kv_heads=num_kv_heads)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    assert calls == [4 * 5]  # every row of every request in one call


def test_batch_plan_marks_uniform_query_batches_only() -> None:
    def plan(seq_lens: list[int], query_lens: list[int]) -> int | None:
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        num_tokens = int(starts[-1])
        metadata = AttentionMetadata(num_tokens, len(seq_lens), max(query_lens), max(seq_lens), starts,
                                     torch.tensor(seq_lens, dtype=torch.int32),
                                     torch.zeros(len(seq_lens), 5, dtype=torch.int32), torch.arange(num_tokens),
                                     starts, torch.tensor(seq_lens, dtype=torch.int32))
        return build_batch_plan(metadata, block_size=16).uniform_query_len

    assert plan([9, 40], [3, 3]) == 3
    assert plan([9, 40], [3, 2]) is None  # not uniform
    assert plan([3, 40], [3, 3]) is None  # a fresh prefill: no context
    assert plan([9, 40], [1, 1]) is None  # plain decodes
    assert plan([90, 90], [17, 17]) is None  # past MAX_UNIFORM_QUERY_LEN
