"""The FlashAttention backend: `flash_attn`'s varlen kernel over the paged cache.

Chosen on CUDA devices of compute capability >= 8.0 where the `flash_attn`
package imports (DESIGN.md). The batch is the same flattened mix as every
backend sees; FlashAttention's causal mask is aligned to the bottom right
when a request has fewer queries than keys, which is exactly "query i sits at
absolute position seq_len - q_len + i".

Upstream FlashAttention-2 reads a paged cache through `block_table` only when
a page holds a multiple of 256 tokens. With such block sizes the kernel reads
the cache in place; with smaller ones (the default 16) this backend gathers
each request's keys through the block table into one contiguous varlen
buffer per layer (the index plan is built once per batch) and calls the same
kernel without a block table. New keys are written by the Triton
cache-write kernel, which skips slot -1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata

# flash_attn (2.x) reads a paged KV cache in place only for these page sizes.
PAGED_BLOCK_MULTIPLE = 256


def _varlen_func() -> Any:
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    """The common metadata plus FlashAttention's per-batch inputs."""

    cu_seqlens_k: torch.Tensor | None = None  # int32 [B + 1]
    # Gather plan (block sizes not readable in place): flat cache slot of
    # every key of every request, concatenated; None when the cache is read
    # through the block table.
    key_slots: torch.Tensor | None = None


def build_key_slots(seq_lens_cpu: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [sum(seq_lens)]: request r's keys 0..seq_lens[r]-1, in order, as
    flat slots (block_id * block_size + offset) of the paged cache."""
    seq_lens = seq_lens_cpu.long()
    req_index = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    positions = torch.arange(int(seq_lens.sum())) - starts[req_index]
    device = block_table.device
    blocks = block_table[req_index.to(device), (positions // block_size).to(device)].long()
    return blocks * block_size + (positions % block_size).to(device)


class FlashAttentionImpl(AttentionImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flash_attn_varlen_func = _varlen_func()
        # (left, right) keys around the diagonal; ours: query_pos - W < key_pos <= query_pos
        self.window_size = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        from pagedllm.attention_backends.triton.reshape_and_cache import reshape_and_cache

        if not isinstance(attn_metadata, FlashAttentionMetadata) or attn_metadata.cu_seqlens_k is None:
            attn_metadata = FlashAttentionBackend.build_metadata(attn_metadata, kv_cache.shape[2])
        num_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key[:num_tokens], value[:num_tokens], key_cache, value_cache, attn_metadata.slot_mapping)

        if attn_metadata.key_slots is None:
            keys, values, block_table = key_cache, value_cache, attn_metadata.block_table
        else:
            flat_shape = (-1, self.num_kv_heads, self.head_size)
            keys = key_cache.reshape(flat_shape).index_select(0, attn_metadata.key_slots)
            values = value_cache.reshape(flat_shape).index_select(0, attn_metadata.key_slots)
            block_table = None
        output = torch.zeros_like(query)
        output[:num_tokens] = self.flash_attn_varlen_func(
            query[:num_tokens],
            keys,
            values,
            cu_seqlens_q=attn_metadata.query_start_loc,
            cu_seqlens_k=attn_metadata.cu_seqlens_k,
            max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=self.window_size,
            softcap=0.0 if self.logits_soft_cap is None else self.logits_soft_cap,
            block_table=block_table,
        )
        return output


class FlashAttentionBackend(AttentionBackend):
    # The standard KV cache layout suits flash_attn: kv_cache[0] is its
    # paged layout [num_blocks, page_size, Hkv, D].
    name = "flash_attn"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttentionImpl

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> FlashAttentionMetadata:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        seq_lens_cpu = common.seq_lens_cpu[: common.num_reqs]
        cu_seqlens_k = torch.zeros(common.num_reqs + 1, dtype=torch.int32)
        torch.cumsum(seq_lens_cpu, 0, out=cu_seqlens_k[1:])
        key_slots = None
        if block_size % PAGED_BLOCK_MULTIPLE != 0:
            key_slots = build_key_slots(seq_lens_cpu, common.block_table, block_size)
        return FlashAttentionMetadata(
            **fields, cu_seqlens_k=cu_seqlens_k.to(common.block_table.device), key_slots=key_slots
        )
