"""Copying whole blocks (every layer's K and V) out of and into the paged cache.

A block travels as one tensor [num_layers, 2, block_size, Hkv, D]; a batch
of n blocks as [n, num_layers, 2, block_size, Hkv, D].
"""

from __future__ import annotations

import torch


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """CPU copy of `block_ids`' K/V in every layer: [n, L, 2, block_size, Hkv, D]."""
    device = kv_caches[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    stacked = torch.stack([cache.index_select(1, index) for cache in kv_caches])  # [L, 2, n, ...]
    return stacked.permute(2, 0, 1, 3, 4, 5).to("cpu").contiguous()


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor) -> None:
    """Write `blocks` [n, L, 2, block_size, Hkv, D] into `block_ids` of every layer."""
    device = kv_caches[0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    data = blocks.to(device=device, dtype=kv_caches[0].dtype)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[:, layer].transpose(0, 1))


def block_shape(num_layers: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (num_layers, 2, block_size, num_kv_heads, head_size)
