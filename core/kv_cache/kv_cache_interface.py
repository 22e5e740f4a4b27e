"""What each attention layer keeps in the KV cache, and how layers share it
(vLLM's hybrid allocator, in its vocabulary).

Every attention layer declares a `KVCacheSpec`: full attention keeps every
token's K/V; a sliding window of W keeps only the blocks its last W tokens
touch. Layers with one spec form a `KVCacheGroupSpec`, with its own block
table per request. All groups draw from one block pool: a block id names
one page in each of `num_kv_tensors` KV tensors, and the i-th layer of every
group reads and writes tensor i (so groups are padded to one size, the
group size). A model with one spec has one group of all its layers and one
tensor per layer: the layout the engine always had.

NOTE: a new kind of layer (latent attention, recurrent state) adds a spec
here (a `KVCacheSpec` subclass, tagged, listed in `AnyKVCacheSpec`) and its
manager in core/kv_cache/single_type_manager.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pagedllm.core.errors import ConfigError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheSpec(msgspec.Struct, frozen=True, tag=True):
    """What one layer keeps per request; equal specs share a group."""

    block_size: int

    def max_num_blocks(self, num_tokens: int, max_num_new_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at most in a group of
        this spec while it computes up to `max_num_new_tokens` of them at once."""
        raise NotImplementedError


class FullAttentionSpec(KVCacheSpec, frozen=True, tag="full_attention"):
    """Every token's K/V stays for the life of the request."""

    def max_num_blocks(self, num_tokens: int, max_num_new_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


class SlidingWindowSpec(KVCacheSpec, frozen=True, tag="sliding_window"):
    """A query at position p reads keys in (p - sliding_window, p]: the
    blocks wholly before that are freed as the request advances."""

    sliding_window: int = 1

    def max_num_blocks(self, num_tokens: int, max_num_new_tokens: int) -> int:
        # The first new token reads sliding_window - 1 keys back; its block
        # may start up to block_size - 1 tokens before them.
        span = self.sliding_window - 1 + min(max_num_new_tokens, num_tokens)
        return min(cdiv(num_tokens, self.block_size), cdiv(span, self.block_size) + 1)


class MLAAttentionSpec(FullAttentionSpec, frozen=True, tag="mla_attention"):
    """Latent attention (DeepSeek's MLA): every token's page is ONE vector,
    the compressed latent c_kv (after its norm, `kv_lora_rank` wide) then the
    shared RoPE key k_pe (`qk_rope_head_dim`), not a K and a V per head.
    Blocks stay for the life of the request, as full attention's: block
    tables, prefix hits and preemption are full attention's, only the page
    differs (attention_backends/mla.py: its layout)."""

    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @property
    def latent_size(self) -> int:
        """Elements one token stores: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


AnyKVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


class KVCacheGroupSpec(msgspec.Struct, frozen=True):
    """Layers (indices into the model's attention layers) with one spec."""

    layer_indices: tuple[int, ...]
    kv_cache_spec: AnyKVCacheSpec


class KVCacheConfig(msgspec.Struct, frozen=True):
    """The groups of one model, and which KV tensor each layer uses."""

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    # tensor_of_layer[i]: the KV tensor attention layer i reads and writes.
    tensor_of_layer: tuple[int, ...]
    num_kv_tensors: int

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        groups = [0] * len(self.tensor_of_layer)
        for group_id, group in enumerate(self.kv_cache_groups):
            for layer_index in group.layer_indices:
                groups[layer_index] = group_id
        return tuple(groups)

    @property
    def needs_null_block(self) -> bool:
        """A group that frees blocks in the middle of a table puts the
        pool's null block (never written, never freed) in their place."""
        return any(not isinstance(group.kv_cache_spec, FullAttentionSpec) for group in self.kv_cache_groups)

    @property
    def is_latent(self) -> bool:
        """Latent (MLA) layers: a page is one latent vector per token."""
        return isinstance(self.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)

    @property
    def is_plain(self) -> bool:
        """One full-attention group of every layer: the classic layout."""
        return self.num_groups == 1 and not self.needs_null_block

    def max_num_blocks(self, num_tokens: int, max_num_new_tokens: int) -> int:
        """Blocks of the pool one request of `num_tokens` holds at most."""
        return sum(
            group.kv_cache_spec.max_num_blocks(num_tokens, max_num_new_tokens) for group in self.kv_cache_groups
        )

    def max_num_tokens(self, num_blocks: int, max_num_new_tokens: int) -> int:
        """The longest request `num_blocks` usable blocks hold (0: none)."""
        low, high = 0, num_blocks * self.kv_cache_groups[0].kv_cache_spec.block_size
        while low < high:
            mid = (low + high + 1) // 2
            if self.max_num_blocks(mid, max_num_new_tokens) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low


def plain_kv_cache_config(num_layers: int, block_size: int) -> KVCacheConfig:
    """One full-attention group of `num_layers` layers, a tensor each."""
    return KVCacheConfig(
        (KVCacheGroupSpec(tuple(range(num_layers)), FullAttentionSpec(block_size)),),
        tuple(range(num_layers)),
        num_layers,
    )


def get_kv_cache_config(layer_specs: Sequence[AnyKVCacheSpec], enable_hybrid: bool = True) -> KVCacheConfig:
    """Group the layers by spec (`layer_specs[i]`: attention layer i's).

    Without `enable_hybrid`, or with one spec, one group holds every layer:
    with hybrid off a sliding-window layer keeps every block (it still
    attends through its window), as before groups existed. With several
    specs every group gets `group_size` layers (the fewest layers of one
    spec, or the most where they are within 25%, as vLLM does; the last
    group of a spec may hold fewer), and the i-th layer of each group
    shares KV tensor i with the i-th of the others.
    """
    if not layer_specs:
        raise ConfigError("model", "no attention layers", "a model with at least one attention layer")
    block_size = layer_specs[0].block_size
    if any(spec.block_size != block_size for spec in layer_specs):
        raise ConfigError("cache.block_size", sorted({s.block_size for s in layer_specs}), "one block size")
    num_latent = sum(isinstance(spec, MLAAttentionSpec) for spec in layer_specs)
    if 0 < num_latent < len(layer_specs):
        raise ConfigError("model", "latent (MLA) and other attention layers in one model",
                          "every attention layer latent, or none")
    if not enable_hybrid and not num_latent:
        # NOTE: a latent layer keeps its spec: its page is another shape.
        layer_specs = [FullAttentionSpec(block_size)] * len(layer_specs)
    layers_of_spec: dict[AnyKVCacheSpec, list[int]] = {}
    for layer_index, spec in enumerate(layer_specs):
        layers_of_spec.setdefault(spec, []).append(layer_index)
    if len(layers_of_spec) == 1:
        ((spec, layers),) = layers_of_spec.items()
        return KVCacheConfig((KVCacheGroupSpec(tuple(layers), spec),), tuple(range(len(layers))), len(layers))
    counts = [len(layers) for layers in layers_of_spec.values()]
    group_size = max(counts) if max(counts) < min(counts) * 1.25 else min(counts)
    groups: list[KVCacheGroupSpec] = []
    # Full attention first (group 0 then answers for the whole prefix), then
    # sliding windows, widest first; each in layer order.
    for spec, layers in sorted(layers_of_spec.items(), key=lambda item: _group_order(item[0], item[1])):
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start : start + group_size]), spec))
    tensor_of_layer = [0] * len(layer_specs)
    for group in groups:
        for position, layer_index in enumerate(group.layer_indices):
            tensor_of_layer[layer_index] = position
    return KVCacheConfig(tuple(groups), tuple(tensor_of_layer), group_size)


def _group_order(spec: KVCacheSpec, layers: list[int]) -> tuple[int, int, int]:
    if isinstance(spec, FullAttentionSpec):
        return (0, 0, layers[0])
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
    return (1, -window, layers[0])
