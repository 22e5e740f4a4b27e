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

from pagedllm.core.kv_cache.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    get_kv_cache_config,
)
from pagedllm.platforms.cpu.host_memory import anonymous_zeros

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, KVCacheLayout
    from pagedllm.model_registry.layers.attention import Attention


class PagedModule(Protocol):
    """A model (or a drafter's head) whose attention layers hold a paged KV cache."""

    def get_attention_layers(self) -> Sequence[Attention]: ...


def get_model_kv_cache_config(model: PagedModule, block_size: int, enable_hybrid: bool = True) -> KVCacheConfig:
    """The KV cache groups of `model`'s attention layers (each declares its
    spec); `enable_hybrid` False: one full-attention group of all of them."""
    specs = [
        # A plugin API 1.0 layer that declares no spec keeps full attention.
        layer.get_kv_cache_spec(block_size) if hasattr(layer, "get_kv_cache_spec") else FullAttentionSpec(block_size)
        for layer in model.get_attention_layers()
    ]
    return get_kv_cache_config(specs, enable_hybrid)


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
    kv_cache_config: KVCacheConfig | None = None,
) -> list[torch.Tensor]:
    """The zeroed KV tensors of `model`, shaped by the backend, each layer
    bound to its own (`layer.kv_cache`, and `layer.kv_cache_group`).
    Without `kv_cache_config` (or with the plain one) one tensor per
    attention layer, in layer order (latent layers: the latent layout); with groups `num_kv_tensors` tensors,
    the i-th layer of every group sharing tensor i.
    `num_kv_heads` is this rank's: the layers' own count (a backend views the
    cache with the layer's count, so a larger cache would go unnoticed)."""
    layers = model.get_attention_layers()
    if kv_cache_config is None:
        kv_cache_config = get_model_kv_cache_config(model, block_size, enable_hybrid=False)
    shape = kv_cache_layout(attn_backend, kv_cache_config).kv_cache_shape(
        num_blocks, block_size, num_kv_heads, head_size
    )
    kv_caches = [zeroed_tensor(shape, dtype, device) for _ in range(kv_cache_config.num_kv_tensors)]
    group_of_layer = kv_cache_config.group_of_layer
    for layer_index, layer in enumerate(layers):
        if layer.num_kv_heads != num_kv_heads:
            raise RuntimeError(f"a KV cache of {num_kv_heads} KV heads for a layer of {layer.num_kv_heads}")
        layer.kv_cache = kv_caches[kv_cache_config.tensor_of_layer[layer_index]]
        layer.kv_cache_group = group_of_layer[layer_index]
    return kv_caches


def kv_cache_layout(attn_backend: type[AttentionBackend], kv_cache_config: KVCacheConfig) -> KVCacheLayout:
    """How each KV tensor holds its blocks: the backend's layout, or its
    latent one for latent (MLA) layers (one vector per token)."""
    if kv_cache_config.is_latent:
        return attn_backend.get_mla_kv_cache_layout()
    return attn_backend.get_kv_cache_layout()


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
        layer.kv_cache_group = 0
