"""Copying whole blocks (every layer's K and V) out of and into the paged cache.

A block travels as one tensor [num_layers, 2, block_size, Hkv, D]; a batch
of n blocks as [n, num_layers, 2, block_size, Hkv, D]. That form is the same
whatever the attention backend's cache layout: each layer's blocks are read
and written through the `KVCacheLayout` (the standard one unless given), so
a block saved by one engine loads into another whose backend lays its cache
out differently.
"""

from __future__ import annotations

import torch

from pagedllm.attention_backends.base import STANDARD_KV_CACHE_LAYOUT, KVCacheLayout


def gather_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], layout: KVCacheLayout = STANDARD_KV_CACHE_LAYOUT
) -> torch.Tensor:
    """CPU copy of `block_ids`' K/V in every layer: [n, L, 2, block_size, Hkv, D]."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # Stacked on the cache's device, so one contiguous copy crosses to the CPU.
    stacked = torch.stack([layout.gather_blocks(cache, index) for cache in kv_caches], dim=1)
    return stacked.to("cpu")


def scatter_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    blocks: torch.Tensor,
    layout: KVCacheLayout = STANDARD_KV_CACHE_LAYOUT,
) -> None:
    """Write `blocks` [n, L, 2, block_size, Hkv, D] into `block_ids` of every layer."""
    device = kv_caches[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = blocks.to(device=device, dtype=kv_caches[0].dtype)
    for layer, cache in enumerate(kv_caches):
        layout.scatter_blocks(cache, index, data[:, layer])


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                layout: KVCacheLayout = STANDARD_KV_CACHE_LAYOUT) -> tuple[int, ...]:
    """One block of every layer as it travels: [L, 2, block_size, Hkv, D]
    (a latent layout's: [L, 1, block_size, 1, latent])."""
    return (num_layers, *layout.block_shape(block_size, num_kv_heads, head_size))
