"""The per-layer paged KV cache tensors of one model.

The one place that allocates them: the target's runner, the model drafters
(their own cache with the target's block geometry, addressed by the same
block tables) and the memory profiler's throwaway cache all come through
`allocate_kv_caches`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pagedllm.platforms.cpu.host_memory import anonymous_zeros

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.model_registry.layers.attention import Attention


class PagedModule(Protocol):
    """A model (or a drafter's head) whose attention layers hold a paged KV cache."""

    def get_attention_layers(self) -> Sequence[Attention]: ...


def allocate_kv_caches(
    model: PagedModule,
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
    each bound to its layer (`layer.kv_cache`), shaped by the backend.
    `num_kv_heads` is this rank's: the layers' own count (a backend views the
    cache with the layer's count, so a larger cache would go unnoticed)."""
    shape = attn_backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    kv_caches: list[torch.Tensor] = []
    for layer in model.get_attention_layers():
        if layer.num_kv_heads != num_kv_heads:
            raise RuntimeError(f"a KV cache of {num_kv_heads} KV heads for a layer of {layer.num_kv_heads}")
        kv_cache = zeroed_tensor(shape, dtype, device)
        layer.kv_cache = kv_cache
        kv_caches.append(kv_cache)
    return kv_caches


def zeroed_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On the CPU its memory is a fresh anonymous mapping
    (platforms/cpu/host_memory.py), whose pages the kernel zero-fills when they
    are first touched, so no page is written now: torch.zeros writes the
    whole 1 GiB default KV cache at start (0.4 s on an idle 2-core machine,
    3 s on a loaded one) for blocks that may never be used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous_zeros(math.prod(shape), dtype).view(*shape)


def unbind_kv_caches(model: PagedModule) -> None:
    """Detach every attention layer of `model` from its KV tensor."""
    for layer in model.get_attention_layers():
        layer.kv_cache = None
