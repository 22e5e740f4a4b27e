"""The AttentionBackend interface.

A backend is a class with static facts (its KV cache layout) and an impl
class that attention layers instantiate. The KV cache layout has one owner,
`KVCacheLayout`: the cache's shape and where each block lives in it, so
allocation and KV connectors ask the layout instead of assuming one.

What the selector needs to choose a backend without importing it lives in
its registration metadata (`AttentionCapabilities`, built from the
``register`` keywords), not in the class.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pagedllm.core.errors import AttentionBackendError
from pagedllm.plugins.metadata import (
    capability,
    count,
    counts,
    dtype_capabilities,
    dtype_names,
    flag,
    names,
    parsed,
)

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch: B requests, T = sum of query lengths.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``.
    Its context after this step is ``seq_lens[r]`` tokens, so its query token
    i sits at absolute position ``seq_lens[r] - query_len[r] + i`` and may
    attend to cache positions ``<=`` that (causal on absolute positions).
    """

    num_actual_tokens: int  # T
    num_reqs: int  # B
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [B + 1], on the device
    seq_lens: torch.Tensor  # int32 [B], on the device
    block_table: torch.Tensor  # int32 [B, max_num_blocks_per_req], on the device
    slot_mapping: torch.Tensor  # int64 [T]; block_id * block_size + offset; -1 = skip
    query_start_loc_cpu: torch.Tensor  # int32 [B + 1]
    seq_lens_cpu: torch.Tensor  # int32 [B]
    # KV cache groups 1.. (a model whose layers keep different KV, e.g.
    # sliding-window and full layers): the same batch over each group's block
    # table, built by the same backend. The metadata itself is group 0's; a
    # layer of group g reads kv_cache_groups[g - 1]. Empty with one group.
    kv_cache_groups: tuple[AttentionMetadata, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a backend supports, declared at registration so that the selector
    (attention_backends/selector.py) can choose without importing the backend.

    Built from ``register(name, target, **capabilities)``; an unknown key or a
    wrong-typed value is an error at ``register``. None = no restriction.
    """

    device_types: tuple[str, ...] | None = parsed(names)  # "cpu", "cuda", ...
    min_capability: tuple[int, int] | None = parsed(capability)  # (major, minor)
    max_capability: tuple[int, int] | None = parsed(capability)
    dtypes: tuple[str, ...] | None = parsed(dtype_names)  # "float16", ...
    head_sizes: tuple[int, ...] | None = parsed(counts)  # an explicit list ...
    head_size_multiple: int | None = parsed(count)  # ... or a multiple
    max_head_size: int | None = parsed(count)  # and a maximum
    block_size_multiple: int | None = parsed(count)
    requires: tuple[str, ...] = parsed(names, ())  # import names that must be installed
    supports_sliding_window: bool = parsed(flag, False)
    # Attention-logit soft cap (Gemma 2: cap * tanh(scores / cap)).
    supports_logits_soft_cap: bool = parsed(flag, False)
    # Per-head attention sinks (GPT-OSS): one learned logit per query head
    # joins each row's softmax and its probability mass is dropped.
    supports_sinks: bool = parsed(flag, False)
    # Latent attention (DeepSeek's MLA, attention_backends/mla.py): the
    # backend's `get_mla_impl_cls` returns an impl.
    supports_mla: bool = parsed(flag, False)
    # KV cache storage dtypes besides the compute dtype ("float8_e4m3fn",
    # "float8_e5m2"; attention_backends/kv_cache_dtype.py): the impl converts
    # on write and read. () = its cache must be in the compute dtype.
    kv_cache_dtypes: tuple[str, ...] = parsed(dtype_names, ())
    # A storage dtype that needs a newer device than the backend itself:
    # {dtype name: minimum compute capability}, kept as (name, capability) pairs.
    kv_cache_dtype_min_capability: tuple[tuple[str, tuple[int, int]], ...] = parsed(dtype_capabilities, ())


@dataclass(frozen=True)
class AttentionRequirements:
    """What a model's attention layers ask of a backend, read from its config
    before the model is built (`ModelForCausalLM.attention_requirements`):
    the selector rejects a backend whose capabilities lack any of it."""

    head_sizes: tuple[int, ...]  # every layer's head size (a model may mix them)
    sliding_window: int | None = None  # the smallest window of any layer; None = none
    logits_soft_cap: float | None = None  # the attention-logit soft cap of any layer
    sinks: bool = False  # per-head attention sinks in some layer
    # Latent attention (MLA): the one vector each token caches,
    # kv_lora_rank + qk_rope_head_dim wide; None = per-head K and V.
    latent_kv_size: int | None = None


class AttentionImpl(ABC):
    """Per-layer attention computation over the paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # [num_heads] of this rank: the model's parameter (loaded later, read
        # at each forward). Each row's softmax gets one more logit, sinks[h],
        # whose probability is dropped (GPT-OSS). Passed only to backends
        # that declare `supports_sinks`.
        self.sinks = sinks
        from pagedllm.attention_backends.kv_cache_dtype import DEFAULT_KV_SCALE

        # An fp8 KV cache holds K / k_scale and V / v_scale (kv_cache_dtype.py);
        # ignored by a cache in the compute dtype.
        self.k_scale = DEFAULT_KV_SCALE
        self.v_scale = DEFAULT_KV_SCALE

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # backend's get_kv_cache_shape(...)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        """Write key/value into kv_cache at slot_mapping, then attend.

        The cache's dtype is its storage dtype: the compute dtype, or an fp8
        dtype the backend declared in ``kv_cache_dtypes`` (then write and
        read through attention_backends/kv_cache_dtype.py, with
        `k_scale` / `v_scale`).

        NOTE: the write happens before any read so that a request whose
        prefix-cache hit covers blocks another request in the same batch is
        computing right now reads the fresh values.
        """


class KVCacheLayout:
    """Where one layer's paged KV cache tensor keeps each block.

    This class is the standard layout, ``[2, num_blocks, block_size,
    num_kv_heads, head_size]``: keys then values, each block-major. A backend
    that stores its cache otherwise subclasses it, overrides the three
    methods, and returns an instance from `AttentionBackend.get_kv_cache_layout`.

    NOTE: whatever the layout, a block leaves and enters the cache in one
    form, ``[2, block_size, num_kv_heads, head_size]`` (K then V), so KV
    connectors move blocks between engines whose backends lay out their
    caches differently, and stored blocks stay readable.
    """

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def block_shape(self, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One block of one layer as it leaves and enters the cache
        (`gather_blocks`): [2, block_size, Hkv, D], whatever the layout."""
        return (2, block_size, num_kv_heads, head_size)

    def bytes_per_block(self, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> int:
        """What one block of one layer's cache takes (the KV cache is sized by it)."""
        return math.prod(self.kv_cache_shape(1, block_size, num_kv_heads, head_size)) * dtype.itemsize

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """A copy of blocks `block_ids` (int64, on the cache's device) of
        one layer's cache: [n, 2, block_size, num_kv_heads, head_size]."""
        from pagedllm.attention_backends.kv_cache_dtype import as_bytes

        # Through bytes: torch lacks some index ops for float8 caches (bit-exact either way).
        return as_bytes(kv_cache).index_select(1, block_ids).transpose(0, 1).view(kv_cache.dtype)

    def scatter_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write `blocks` [n, 2, block_size, num_kv_heads, head_size] (on the
        cache's device, in its dtype) into blocks `block_ids` of one layer's cache."""
        from pagedllm.attention_backends.kv_cache_dtype import as_bytes

        as_bytes(kv_cache).index_copy_(1, block_ids, as_bytes(blocks).transpose(0, 1))

    def ensure_blocks_movable(self) -> None:
        """Raise AttentionBackendError if blocks of this layout cannot be
        gathered or scattered; connectors call it at start-up so the error
        comes before the first request does."""


# The standard layout; a stateless singleton.
STANDARD_KV_CACHE_LAYOUT = KVCacheLayout()


class MLAKVCacheLayout(KVCacheLayout):
    """A latent layer's cache: ``[1, num_blocks, block_size, 1, latent]``,
    one plane of one "head" whose size is kv_lora_rank + qk_rope_head_dim
    (the standard layout's K plane alone), so a block moves as
    ``[1, block_size, 1, latent]`` through the standard gather and scatter.
    Callers pass num_kv_heads=1 and head_size=latent."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, num_kv_heads, head_size)

    def block_shape(self, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (1, block_size, num_kv_heads, head_size)


# The latent layout (attention_backends/mla.py); a stateless singleton.
MLA_KV_CACHE_LAYOUT = MLAKVCacheLayout()


class UndeclaredKVCacheLayout(KVCacheLayout):
    """The layout of a plugin API 1.0 backend whose own `get_kv_cache_shape`
    is not the standard shape and which declares no layout: its caches are
    allocated as that shape, but where a block lives is unknown, so moving
    blocks (what a KV connector does) is an AttentionBackendError."""

    def __init__(self, backend: type[AttentionBackend]) -> None:
        self.backend = backend

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return tuple(self.backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        raise self._not_movable()

    def scatter_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        raise self._not_movable()

    def ensure_blocks_movable(self) -> None:
        raise self._not_movable()

    def _not_movable(self) -> AttentionBackendError:
        reason = (
            "its get_kv_cache_shape() is not the standard [2, num_blocks, block_size, num_kv_heads, head_size] "
            "and it declares no get_kv_cache_layout(), so a KV connector cannot move its blocks"
        )
        return AttentionBackendError(getattr(self.backend, "name", self.backend.__qualname__), [reason])


# Sizes to tell a 1.0 backend's shape from the standard one: all distinct
# (and distinct from 2), so any reordering of the dimensions shows; common
# enough (block 16, head 64) that a backend validating its sizes accepts them.
_LAYOUT_PROBE_SIZES = (3, 16, 4, 64)  # num_blocks, block_size, num_kv_heads, head_size


class AttentionBackend(ABC):
    name: ClassVar[str]

    @classmethod
    def get_kv_cache_layout(cls) -> KVCacheLayout:
        """How this backend's KV cache holds its blocks (plugin API 1.2).

        A backend with its own layout overrides this with a `KVCacheLayout`
        subclass and inherits `get_kv_cache_shape`. The default, for backends
        written for 1.0: a backend that does not override
        `get_kv_cache_shape` has the standard layout; one that does has the
        standard layout if its shape (for distinct probe sizes) is the
        standard shape, and otherwise an `UndeclaredKVCacheLayout`: it runs
        as before, and only a KV connector refuses it, at start-up.
        """
        shape_owner = next(klass for klass in cls.__mro__ if "get_kv_cache_shape" in vars(klass))
        if shape_owner is AttentionBackend:
            return STANDARD_KV_CACHE_LAYOUT
        probe = _LAYOUT_PROBE_SIZES
        if tuple(cls.get_kv_cache_shape(*probe)) == STANDARD_KV_CACHE_LAYOUT.kv_cache_shape(*probe):
            return STANDARD_KV_CACHE_LAYOUT
        return UndeclaredKVCacheLayout(cls)

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor: the layout's. (1.0 backends
        override it, as a staticmethod; see `get_kv_cache_layout`.)"""
        return cls.get_kv_cache_layout().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The AttentionImpl subclass layers instantiate."""

    @classmethod
    def get_mla_impl_cls(cls) -> type[Any]:
        """The `MLAAttentionImpl` subclass (attention_backends/mla.py; not
        named here: mla.py builds on this module) that latent (MLA) layers
        instantiate; a backend that serves them overrides this and registers
        with ``supports_mla=True``."""
        raise AttentionBackendError(getattr(cls, "name", cls.__qualname__),
                                    ["latent attention (MLA) is not implemented by this backend"])

    @classmethod
    def get_mla_kv_cache_layout(cls) -> KVCacheLayout:
        """How a latent layer's cache holds its blocks (default: one plane of
        one latent vector per token, `MLAKVCacheLayout`)."""
        return MLA_KV_CACHE_LAYOUT

    @classmethod
    def supports_graph_capture(cls, block_size: int) -> bool:
        """Whether a forward can be captured in a graph and replayed
        (worker/decode_graphs.py): it must read only the metadata's device
        tensors, and host values that stay fixed for a batch size."""
        return False

    @classmethod
    def supports_uniform_query_capture(cls, block_size: int) -> bool:
        """Whether a batch in which every request scores the same q > 1
        tokens over its context (a speculative verify step) can be captured
        too, on the same terms (the host's `max_query_len` is q, fixed)."""
        return False

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """Per-batch work every layer would otherwise repeat (index plans,
        masks, scheduler metadata of a kernel), done once per forward by the
        model runner. Return `common` itself or a subclass of it."""
        return common
