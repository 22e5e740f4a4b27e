"""The AttentionBackend interface.

A backend is a class with static facts (KV cache shape) and an impl class
that attention layers instantiate. What the selector needs to choose a
backend without importing it lives in its registration metadata
(see plugins/builtin.py), not here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

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
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

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

        NOTE: the write happens before any read so that a request whose
        prefix-cache hit covers blocks another request in the same batch is
        computing right now reads the fresh values.
        """


class AttentionBackend(ABC):
    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The AttentionImpl subclass layers instantiate."""

    @classmethod
    def supports_graph_capture(cls, block_size: int) -> bool:
        """Whether a forward can be captured in a graph and replayed
        (worker/decode_graphs.py): it must read only the metadata's device
        tensors, and host values that stay fixed for a batch size."""
        return False

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """Per-batch work every layer would otherwise repeat (index plans,
        masks, scheduler metadata of a kernel), done once per forward by the
        model runner. Return `common` itself or a subclass of it."""
        return common
