"""Write a step's new keys and values into the paged KV cache (Triton).

Token t goes to slot `slot_mapping[t]` = block_id * block_size + offset; a
slot of -1 (a token whose KV must not be stored, such as a padded row of a
captured CUDA-graph batch) is skipped. One program per token copies all its
KV heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    value_cache_ptr,
    slot_mapping_ptr,  # int64 [T]
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_blk,
    stride_kc_pos,
    stride_kc_h,
    stride_vc_blk,
    stride_vc_pos,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)
    key = tl.load(key_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    tl.store(
        key_cache_ptr + block * stride_kc_blk + offset * stride_kc_pos
        + offs_h[:, None] * stride_kc_h + offs_d[None, :],
        key.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + block * stride_vc_blk + offset * stride_vc_pos
        + offs_h[:, None] * stride_vc_h + offs_d[None, :],
        value.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [>= T]; -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=key_cache.shape[1],
    )
