"""Paged attention, one ``torch.nn.functional.scaled_dot_product_attention``
call per request.

Per layer: write the new K/V at ``slot_mapping``, then for each request gather
its keys and values through its block table (positions ``0 .. seq_len-1``)
and attend with the causal rule on absolute positions. Everything that depends
only on the batch (slots to gather, masks) is computed once per forward in
``SdpaBackend.build_metadata`` and shared by all layers.

Simpler (and slower on many small decodes) than the built-in torch_native
backend, which pads requests into at most two batched calls; the two must
agree to rounding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedllm.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.core.errors import AttentionBackendError


@dataclass
class SdpaRequestPlan:
    """One request of the batch: its query rows and the cache slots of its keys."""

    query_start: int
    query_end: int
    key_slots: torch.Tensor  # int64 [seq_len]: flat cache slot of key position 0 .. seq_len-1
    # bool [query_len, seq_len], True = attend; None when no mask is needed
    # (a decode sees every key) or when is_causal says it (query covers the context).
    mask: torch.Tensor | None
    is_causal: bool


@dataclass
class SdpaMetadata(AttentionMetadata):
    """The common metadata plus this backend's per-request plan."""

    write_rows: torch.Tensor | None = None  # rows whose slot is not -1; None = all
    write_slots: torch.Tensor | None = None
    requests: list[SdpaRequestPlan] = field(default_factory=list)


def plan_requests(attn_metadata: AttentionMetadata, block_size: int) -> list[SdpaRequestPlan]:
    query_start_loc = attn_metadata.query_start_loc_cpu.tolist()
    seq_lens = attn_metadata.seq_lens_cpu.tolist()
    block_table = attn_metadata.block_table
    device = block_table.device
    plans = []
    for req in range(attn_metadata.num_reqs):
        query_start, query_end, seq_len = query_start_loc[req], query_start_loc[req + 1], seq_lens[req]
        query_len = query_end - query_start
        key_pos = torch.arange(seq_len, device=device)
        key_slots = block_table[req, key_pos // block_size].long() * block_size + key_pos % block_size
        mask = None
        is_causal = query_len == seq_len and query_len > 1
        if 1 < query_len < seq_len:  # a prefill chunk after cached context: bottom-right causal
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
        plans.append(SdpaRequestPlan(query_start, query_end, key_slots, mask, is_causal))
    return plans


class SdpaAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        # NOTE: the selector already rejects sliding windows (registration
        # metadata); a soft cap has no metadata key, so refuse it here.
        if sliding_window is not None or logits_soft_cap is not None:
            raise AttentionBackendError(
                "sdpa",
                [f"sliding_window={sliding_window!r} and logits_soft_cap={logits_soft_cap!r}: supports neither"],
            )
        super().__init__(num_heads, head_size, scale, num_kv_heads)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        if not isinstance(attn_metadata, SdpaMetadata):  # not built by this backend: plan here
            attn_metadata = SdpaBackend.build_metadata(attn_metadata, kv_cache.shape[2])
        assert attn_metadata.write_slots is not None
        num_tokens = attn_metadata.num_actual_tokens
        query, key, value = query[:num_tokens], key[:num_tokens], value[:num_tokens]

        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)  # [slots, Hkv, D]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        rows = attn_metadata.write_rows
        key_cache.index_copy_(0, attn_metadata.write_slots, key if rows is None else key[rows])
        value_cache.index_copy_(0, attn_metadata.write_slots, value if rows is None else value[rows])

        output = torch.empty_like(query)
        for plan in attn_metadata.requests:
            q = query[plan.query_start : plan.query_end].transpose(0, 1)  # [H, Q, D]
            k = key_cache.index_select(0, plan.key_slots).transpose(0, 1)  # [Hkv, S, D]
            v = value_cache.index_select(0, plan.key_slots).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=plan.mask,
                is_causal=plan.is_causal,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            output[plan.query_start : plan.query_end] = out.transpose(0, 1)
        return output


class SdpaBackend(AttentionBackend):
    name: ClassVar[str] = "sdpa"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return SdpaAttentionImpl

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> SdpaMetadata:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        slot_mapping = common.slot_mapping[: common.num_actual_tokens].long()
        is_written = slot_mapping >= 0
        write_rows = None if bool(is_written.all()) else is_written.nonzero().squeeze(1)
        write_slots = slot_mapping if write_rows is None else slot_mapping[write_rows]
        return SdpaMetadata(
            **fields, write_rows=write_rows, write_slots=write_slots, requests=plan_requests(common, block_size)
        )
