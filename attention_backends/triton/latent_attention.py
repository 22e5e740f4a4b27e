"""Latent attention (DeepSeek's MLA) over the paged latent cache, in Triton.

The cache holds one vector per token, [c_kv (L = kv_lora_rank), k_pe (R =
qk_rope_head_dim)], in ``[1, num_blocks, block_size, 1, L + R]``
(attention_backends/mla.py).

- `write_latent_cache`: one program per token copies [c_kv, k_pe] into its
  slot; a slot of -1 is skipped.
- `latent_attention`: the absorbed form. One program per (query token,
  BLOCK_H heads) finds its request by binary search over `query_start_loc`,
  walks the request's keys 0..its own position (causal on absolute
  positions, so decodes, verify steps and chunks over cached context alike)
  through the block table, scores q_lat . c_kv + q_pe . k_pe and keeps an
  online softmax in float32; its output is the softmax-weighted latent,
  [T, H, L]. Each loaded key tile serves BLOCK_H heads. The grid depends on
  the token count and head count alone and every per-request value is read
  on the device: a launch is safe to capture in a CUDA graph.

NOTE: `tl.dot` needs every dimension >= 16: the head block is at least 16
rows (masked heads) and L, R are padded to powers of two (>= 16) and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT_SIZE = 16
# Keys per loop step: a [TILE, L + R] latent tile (L = 512: 36 KiB in 16 bits).
LATENT_TILE = 32


@triton.jit
def _write_latent_kernel(
    kv_c_ptr,  # [T, L]
    k_pe_ptr,  # [T, R]
    cache_ptr,  # flat slots [num_slots, L + R]
    slot_mapping_ptr,  # int64 [T]
    stride_c_t,
    stride_pe_t,
    stride_slot,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PADDED: tl.constexpr,
    ROPE_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_l = tl.arange(0, RANK_PADDED)
    offs_r = tl.arange(0, ROPE_PADDED)
    kv_c = tl.load(kv_c_ptr + token * stride_c_t + offs_l, mask=offs_l < RANK)
    k_pe = tl.load(k_pe_ptr + token * stride_pe_t + offs_r, mask=offs_r < ROPE)
    dst = cache_ptr + slot * stride_slot
    tl.store(dst + offs_l, kv_c.to(cache_ptr.dtype.element_ty), mask=offs_l < RANK)
    tl.store(dst + RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty), mask=offs_r < ROPE)


def _next_power_of_2(n: int) -> int:
    return max(MIN_DOT_SIZE, 1 << max(0, (n - 1).bit_length()))


def _power_of_2_dividing(n: int, cap: int = 16) -> int:
    """The largest power of two, at most `cap`, that divides `n`."""
    return min(cap, n & -n) if n else cap


def _flat_slots(kv_cache: torch.Tensor) -> torch.Tensor:
    """[1, num_blocks, block_size, 1, L + R] -> [num_slots, L + R] (a view)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(f"expected a latent cache [1, num_blocks, block_size, 1, L + R], got {tuple(kv_cache.shape)}")
    return kv_cache[0].view(-1, kv_cache.shape[-1])


def write_latent_cache(
    kv_c: torch.Tensor,  # [T, L], already in the cache's dtype
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
    slot_mapping: torch.Tensor,  # int64 [>= T]; -1 = skip
) -> None:
    """Token t's [kv_c[t], k_pe[t]] into slot `slot_mapping[t]`."""
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    cache = _flat_slots(kv_cache)
    if cache.shape[1] != rank + rope:
        raise ValueError(f"latent cache width {cache.shape[1]} != kv_lora_rank {rank} + rope {rope}")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("kv_c and k_pe must be contiguous in their last dimension")
    if num_tokens == 0:
        return
    _write_latent_kernel[(num_tokens,)](
        kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(0),
        RANK=rank, ROPE=rope, RANK_PADDED=_next_power_of_2(rank), ROPE_PADDED=_next_power_of_2(rope),
    )


@triton.jit
def _find_token_request(query_start_loc_ptr, token, num_reqs):
    """The last request r with query_start_loc[r] <= token (empty requests skipped)."""
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _load_latent_tile(cache_ptr, block_table_ptr, req, stride_bt, stride_slot, offs_n, key_ok, offs_l, offs_r,
                      RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOT_ALIGN: tl.constexpr):
    """The keys `offs_n` of request `req`: (c_kv [TILE, L_PAD], k_pe [TILE, R_PAD])."""
    physical_block = tl.load(block_table_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
    slots = physical_block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    # NOTE: what a row's start is really a multiple of. Without it Triton
    # (3.6, compiled) took slots * stride as a multiple of 16, from the
    # 16-aligned runs of `slots`, and loaded rows of an odd width
    # (L + R = 30 floats) with 16-byte vectors: a misaligned address.
    rows = cache_ptr + tl.multiple_of(slots[:, None] * stride_slot, [SLOT_ALIGN, SLOT_ALIGN])
    kv_c = tl.load(rows + offs_l[None, :], mask=key_ok[:, None] & (offs_l[None, :] < RANK), other=0.0)
    k_pe = tl.load(rows + RANK + offs_r[None, :], mask=key_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)
    return kv_c, k_pe


@triton.jit
def _latent_attention_kernel(
    out_ptr,  # [T, H, L]
    q_lat_ptr,  # [T, H, L]
    q_pe_ptr,  # [T, H, R]
    cache_ptr,  # flat slots [num_slots, L + R]
    block_table_ptr,  # int32 [B, max_blocks]
    seq_lens_ptr,  # int32 [B]
    query_start_loc_ptr,  # int32 [B + 1]
    num_reqs,
    scale,
    kv_scale,  # an fp8 cache holds the latent / kv_scale
    stride_lat_t, stride_lat_h, stride_pe_t, stride_pe_h, stride_o_t, stride_o_h, stride_slot, stride_bt,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PADDED: tl.constexpr,
    ROPE_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLOT_ALIGN: tl.constexpr,  # the power of two (at most 16) that divides stride_slot
    TILE: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 inputs: exact products, not TF32
    KV_FP8: tl.constexpr,
    SKIP_FRESH_PREFILLS: tl.constexpr,  # the caller attends requests with no cached context itself
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    req = _find_token_request(query_start_loc_ptr, token, num_reqs)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if SKIP_FRESH_PREFILLS:  # noqa: SIM102 - a constexpr branch, then a run-time one
        if (q_len > 1) & (q_len == seq_len):
            return
    num_keys = seq_len - q_len + (token - q_start) + 1  # up to and including the token's own position

    offs_l = tl.arange(0, RANK_PADDED)
    offs_r = tl.arange(0, ROPE_PADDED)
    head_ok = heads < NUM_HEADS
    token64 = token.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + token64 * stride_lat_t + heads[:, None] * stride_lat_h + offs_l[None, :],
                    mask=head_ok[:, None] & (offs_l[None, :] < RANK), other=0.0)
    q_pe = tl.load(q_pe_ptr + token64 * stride_pe_t + heads[:, None] * stride_pe_h + offs_r[None, :],
                   mask=head_ok[:, None] & (offs_r[None, :] < ROPE), other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PADDED], dtype=tl.float32)
    for tile in range(0, tl.cdiv(num_keys, TILE)):
        offs_n = tile * TILE + tl.arange(0, TILE)
        key_ok = offs_n < num_keys
        kv_c, k_pe = _load_latent_tile(cache_ptr, block_table_ptr, req, stride_bt, stride_slot, offs_n, key_ok,
                                       offs_l, offs_r, RANK, ROPE, BLOCK_SIZE, SLOT_ALIGN)
        if KV_FP8:
            kv_c = (kv_c.to(tl.float32) * kv_scale).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float32) * kv_scale).to(q_lat.dtype)
        if IEEE_DOT:
            scores = tl.dot(q_lat, tl.trans(kv_c), input_precision="ieee")
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            scores = tl.dot(q_lat, tl.trans(kv_c)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every tile holds a visible key
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE_DOT:
            acc += tl.dot(p.to(kv_c.dtype), kv_c, input_precision="ieee")
        else:
            acc += tl.dot(p.to(kv_c.dtype), kv_c)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + token64 * stride_o_t + heads[:, None] * stride_o_h + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (offs_l[None, :] < RANK))


def latent_attention(
    out: torch.Tensor,  # [T, H, L]
    q_lat: torch.Tensor,  # [T, H, L], the absorbed query
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    *,
    num_reqs: int,
    scale: float,
    kv_scale: float = 1.0,
    skip_fresh_prefills: bool = False,
) -> torch.Tensor:
    """Writes `out`: per token and head, the softmax-weighted cached latents
    over the token's request's keys up to its own position.

    A cache of another dtype than the query (fp8) is read as
    ``cache.to(query dtype) * kv_scale``. `skip_fresh_prefills` leaves the
    rows of requests whose every key is new (query length == sequence
    length > 1) unwritten. Only the token count, the head count and
    `num_reqs` (host integers) shape the launch.
    """
    num_tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    cache = _flat_slots(kv_cache)
    if cache.shape[1] != rank + rope:
        raise ValueError(f"latent cache width {cache.shape[1]} != kv_lora_rank {rank} + rope {rope}")
    for name, tensor in (("out", out), ("q_lat", q_lat), ("q_pe", q_pe)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if num_tokens == 0:
        return out
    # NOTE: 16 heads (tl.dot's minimum) per program: a [16, 512] float32
    # accumulator already fills a program's registers at DeepSeek's L = 512.
    block_h = MIN_DOT_SIZE
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _latent_attention_kernel[grid](
        out, q_lat, q_pe, cache, block_table, seq_lens, query_start_loc, num_reqs, scale, kv_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), block_table.stride(0),
        NUM_HEADS=num_heads, RANK=rank, ROPE=rope, RANK_PADDED=_next_power_of_2(rank),
        ROPE_PADDED=_next_power_of_2(rope), BLOCK_H=block_h, BLOCK_SIZE=kv_cache.shape[2],
        SLOT_ALIGN=_power_of_2_dividing(cache.stride(0)), TILE=LATENT_TILE,
        IEEE_DOT=q_lat.dtype == torch.float32, KV_FP8=cache.dtype != q_lat.dtype,
        SKIP_FRESH_PREFILLS=skip_fresh_prefills,
    )
    return out
