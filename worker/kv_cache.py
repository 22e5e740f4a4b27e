"""The per-layer paged KV cache tensors of one model.

The one place that allocates them: the target's runner, the model drafters
(their own cache with the target's block geometry, addressed by the same
block tables) and the memory profiler's throwaway cache all come through
`allocate_kv_caches`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


def allocate_kv_caches(
    model: torch.nn.Module,
    attn_backend: type[AttentionBackend],
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed KV tensor per attention layer of `model`, in layer order,
    each bound to its layer (`layer.kv_cache`), shaped by the backend."""
    shape = attn_backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    kv_caches: list[torch.Tensor] = []
    for layer in model.get_attention_layers():  # type: ignore[operator]
        kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.kv_cache = kv_cache
        kv_caches.append(kv_cache)
    return kv_caches


def unbind_kv_caches(model: torch.nn.Module) -> None:
    """Detach every attention layer of `model` from its KV tensor."""
    for layer in model.get_attention_layers():  # type: ignore[operator]
        layer.kv_cache = None
