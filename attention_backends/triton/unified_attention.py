"""Unified paged attention in Triton: one kernel for a flattened mixed batch.

Prefill chunks (with cached context) and decodes run in the same launch. A
program owns BLOCK_Q query tokens of one request and one KV head; its rows
are those tokens times the KV head's query heads (GQA packing), so each K/V
tile loaded from the paged cache serves every query head that reads it.
Programs find their request by binary search over `query_start_loc`, so the
grid depends only on the number of tokens and requests (never on sequence
lengths): a launch is safe to capture in a CUDA graph.

Scores are masked causally on absolute positions (query i of a request with
`seq_len` keys after this step and `q_len` new tokens sits at
`seq_len - q_len + i`), optionally by a sliding window (a key is visible when
`query_pos - window < key_pos <= query_pos`) and soft-capped
(`cap * tanh(s / cap)`), with an online softmax in float32. Attention sinks
(GPT-OSS: one learned logit per query head that joins the softmax and whose
probability is dropped) start each row's running max at its sink and its
sum of exponentials at 1 (exp(sink - sink)); split-KV adds them at the merge.

Split-KV ("segments"): for long decodes at small batch, one program per
(request, KV head) leaves most of the GPU idle. `num_segments > 1` splits
each request's key range into that many segments, run by separate programs
that write partial results (running max, sum of exponentials and
unnormalized output); a second kernel merges them.

NOTE: `tl.dot` needs every dimension >= 16, so head sizes are padded to a
power of two (>= 16) and masked, and a program has at least 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT_SIZE = 16


@triton.jit
def _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include global block `q_block_idx`.

    Request r's blocks start at query_start_loc[r] // BLOCK_Q + r (an upper
    bound on the blocks before it, one extra per request for partial blocks).
    """
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _unified_attention_kernel(
    out_ptr,  # [T, H, D], or partial outputs [T, H, S, D_PAD] (float32) when NUM_SEGMENTS > 1
    seg_max_ptr,  # [T, H, S] float32 (only with NUM_SEGMENTS > 1)
    seg_sum_ptr,  # [T, H, S] float32
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v_cache_ptr,
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    sinks_ptr,  # float32 [H] (read only with USE_SINKS)
    num_reqs,
    scale,
    soft_cap,
    k_scale,  # an fp8 cache holds K / k_scale, V / v_scale
    v_scale,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_blk,
    stride_k_pos,
    stride_k_h,
    stride_v_blk,
    stride_v_pos,
    stride_v_h,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    USE_SOFT_CAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 inputs: exact products, not TF32
    NUM_SEGMENTS: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is fp8: dequantize each tile to the query's dtype
    USE_SINKS: tl.constexpr,  # only with NUM_SEGMENTS == 1 (the merge adds them otherwise)
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, q_block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block_idx - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= q_len:
        return  # one of the spare blocks of the grid's upper bound

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    q_in_block = offs_m // NUM_QUERIES_PER_KV
    q_idx = local_block * BLOCK_Q + q_in_block  # query index within the request
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (q_in_block < BLOCK_Q) & (q_idx < q_len)
    dim_ok = offs_d < HEAD_SIZE

    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    query_pos = context_len + q_idx  # absolute positions of the rows

    # Keys this block can see: up to its last query's position, and, with a
    # window, from its first query's window start.
    last_q = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q + 1
    first_key = 0
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(context_len + local_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    first_tile = first_key // TILE
    last_tile = tl.cdiv(num_keys, TILE)
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(last_tile - first_tile, NUM_SEGMENTS)
        first_tile = first_tile + segment * tiles_per_segment
        last_tile = tl.minimum(first_tile + tiles_per_segment, last_tile)

    if USE_SINKS:
        # The sink as the first "key": running max = sink, sum = exp(0), no value.
        m_i = tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)

    for tile in range(first_tile, last_tile):
        offs_n = tile * TILE + tl.arange(0, TILE)
        key_ok = offs_n < num_keys
        physical_block = tl.load(block_table_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
        physical_block = physical_block.to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + physical_block[None, :] * stride_k_blk
            + in_block[None, :] * stride_k_pos
            + kv_head * stride_k_h
            + offs_d[:, None],
            mask=dim_ok[:, None] & key_ok[None, :],
            other=0.0,
        )  # [D_PAD, TILE]
        v = tl.load(
            v_cache_ptr
            + physical_block[:, None] * stride_v_blk
            + in_block[:, None] * stride_v_pos
            + kv_head * stride_v_h
            + offs_d[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE, D_PAD]
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)

        if IEEE_DOT:  # noqa: SIM108 - a constexpr branch: each compiled kernel keeps one dot
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale
        if USE_SOFT_CAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), finite for every x
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap) + 1.0))
        visible = (offs_n[None, :] <= query_pos[:, None]) & row_ok[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (offs_n[None, :] > query_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with nothing visible yet keeps max -inf: shift by 0 instead
        # so that exp() gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # Partial results: [T, H, S, D_PAD] and [T, H, S], contiguous; the
        # launcher passes the strides of a [T, H] index (H and 1).
        stat_offset = (q_rows * stride_o_t + head * stride_o_h) * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + stat_offset, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + stat_offset, l_i, mask=row_ok)
        tl.store(
            out_ptr + stat_offset[:, None] * HEAD_SIZE_PADDED + offs_d[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [T, H, S, D_PAD] float32
    seg_max_ptr,  # [T, H, S] float32
    seg_sum_ptr,
    sinks_ptr,  # float32 [H] (read only with USE_SINKS)
    num_heads,
    stride_o_t,
    stride_o_h,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENTS_PADDED: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SEGMENTS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    seg_ok = offs_s < NUM_SEGMENTS
    base = (token * num_heads + head) * NUM_SEGMENTS
    seg_max = tl.load(seg_max_ptr + base + offs_s, mask=seg_ok, other=float("-inf"))
    seg_sum = tl.load(seg_sum_ptr + base + offs_s, mask=seg_ok, other=0.0)
    overall_max = tl.max(seg_max, axis=0)  # finite: some segment holds the query's own key
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        overall_max = tl.maximum(overall_max, sink)
    weight = tl.where(seg_max > float("-inf"), tl.exp(seg_max - overall_max), 0.0)
    total = tl.sum(seg_sum * weight, axis=0)
    if USE_SINKS:
        total += tl.exp(sink - overall_max)  # in the denominator only: its probability is dropped
    partial = tl.load(
        partial_ptr + (base + offs_s[:, None]) * HEAD_SIZE_PADDED + offs_d[None, :],
        mask=seg_ok[:, None],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_shape(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per program and rows per program.

    Rows are BLOCK_Q tokens x the KV head's query heads. Decodes use the
    minimum 16 rows; longer queries use 64 so that prefills load each K/V
    tile for more queries.
    """
    num_queries_per_kv = num_heads // num_kv_heads
    rows = 64 if max_query_len * num_queries_per_kv > 16 else MIN_DOT_SIZE
    block_m = max(rows, _next_power_of_2(num_queries_per_kv))
    return block_m // num_queries_per_kv, block_m


def unified_attention(
    out: torch.Tensor,  # [T, H, D]
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    *,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_segments: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every query row of a flattened batch; writes `out`.

    A cache of another dtype than the query (fp8) is read as
    ``cache.to(query dtype) * scale`` (`k_scale`, `v_scale`).

    `sinks` ([H], on the device): each query head's sink logit, one more
    logit in every row's softmax whose probability is dropped.

    `num_segments > 1` takes the split-KV path (meant for decode batches).
    Only `num_reqs` and `max_query_len` (host integers) shape the launch.
    """
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    num_queries_per_kv = num_heads // num_kv_heads
    sink_logits = query if sinks is None else sinks.detach().to(torch.float32).contiguous()  # query: never read
    block_q, block_m = launch_shape(num_heads, num_kv_heads, max_query_len)
    head_size_padded = max(MIN_DOT_SIZE, _next_power_of_2(head_size))
    tile = max(MIN_DOT_SIZE, min(block_size, 64))
    # Enough blocks for every request's queries; spare ones exit at once.
    num_q_blocks = num_tokens // block_q + num_reqs
    common = dict(
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_SIZE=block_size,
        TILE=tile,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFT_CAP=soft_cap is not None,
        IEEE_DOT=query.dtype == torch.float32,
        KV_FP8=key_cache.dtype != query.dtype,
    )
    args = (
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        sink_logits,
        num_reqs,
        scale,
        soft_cap or 1.0,
        k_scale,
        v_scale,
        query.stride(0),
        query.stride(1),
    )
    cache_strides = (
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
    )
    if num_segments == 1:
        _unified_attention_kernel[(num_q_blocks, num_kv_heads, 1)](
            out, out, out, *args, out.stride(0), out.stride(1), *cache_strides,
            NUM_SEGMENTS=1, USE_SINKS=sinks is not None, **common,
        )
        return out

    partial = torch.empty(
        num_tokens, num_heads, num_segments, head_size_padded, dtype=torch.float32, device=query.device
    )
    seg_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=query.device)
    seg_sum = torch.empty_like(seg_max)
    _unified_attention_kernel[(num_q_blocks, num_kv_heads, num_segments)](
        partial, seg_max, seg_sum, *args, num_heads, 1, *cache_strides,
        NUM_SEGMENTS=num_segments, USE_SINKS=False, **common,
    )
    _merge_segments_kernel[(num_tokens, num_heads)](
        out, partial, seg_max, seg_sum, sink_logits, num_heads, out.stride(0), out.stride(1),
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        NUM_SEGMENTS=num_segments,
        SEGMENTS_PADDED=_next_power_of_2(num_segments),
        USE_SINKS=sinks is not None,
    )
    return out
