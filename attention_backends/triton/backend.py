"""TritonBackend: the paged KV cache written by `reshape_and_cache`, read by
`unified_attention`; split-KV for long decodes at small batch. Latent
(MLA) layers get `TritonMLAImpl` (triton/mla.py)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention_backends.kv_cache_dtype import quantize_kv
from pagedllm.attention_backends.triton.reshape_and_cache import reshape_and_cache
from pagedllm.attention_backends.triton.unified_attention import unified_attention

if TYPE_CHECKING:
    from pagedllm.attention_backends.mla import MLAAttentionImpl

# Split-KV heuristic: a pure-decode batch of at most SPLIT_KV_MAX_REQS
# requests whose longest sequence has at least SPLIT_KV_MIN_SEQ_LEN keys is
# split into one segment per SPLIT_KV_KEYS_PER_SEGMENT keys, at most
# MAX_NUM_SEGMENTS. Below that, one program per (request, KV head) already
# has enough keys in flight or the merge costs more than it saves.
SPLIT_KV_MAX_REQS = 32
SPLIT_KV_MIN_SEQ_LEN = 1024
SPLIT_KV_KEYS_PER_SEGMENT = 512
MAX_NUM_SEGMENTS = 16


def choose_num_segments(num_reqs: int, max_query_len: int, max_seq_len: int) -> int:
    """How many key segments each decode splits into (1 = no split)."""
    if max_query_len != 1 or num_reqs > SPLIT_KV_MAX_REQS or max_seq_len < SPLIT_KV_MIN_SEQ_LEN:
        return 1
    return max(2, min(MAX_NUM_SEGMENTS, -(-max_seq_len // SPLIT_KV_KEYS_PER_SEGMENT)))


@dataclass
class TritonMetadata(AttentionMetadata):
    """The common metadata plus the launch decision shared by all layers."""

    num_segments: int = 1


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # NOTE: an fp8 cache's values are converted by torch (round to nearest
        # even, saturated), not in the kernel: bit-identical to the
        # torch-native backend's on every device (Triton's interpreter rounds
        # float8_e5m2 otherwise). The kernel then copies bytes.
        key = quantize_kv(key[:num_tokens], key_cache.dtype, self.k_scale)
        value = quantize_kv(value[:num_tokens], value_cache.dtype, self.v_scale)
        reshape_and_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        num_segments = attn_metadata.num_segments if isinstance(attn_metadata, TritonMetadata) else 1
        # Rows past num_actual_tokens (padding of a captured batch) stay as they are.
        output = torch.zeros_like(query)
        unified_attention(
            output[:num_tokens],
            query[:num_tokens],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            num_reqs=attn_metadata.num_reqs,
            max_query_len=attn_metadata.max_query_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            num_segments=num_segments,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return output


class TritonBackend(AttentionBackend):
    name = "triton"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @classmethod
    def get_mla_impl_cls(cls) -> type[MLAAttentionImpl]:
        from pagedllm.attention_backends.triton.mla import TritonMLAImpl

        return TritonMLAImpl

    @classmethod
    def supports_graph_capture(cls, block_size: int) -> bool:
        # The grid depends on the token and request counts alone; sequence
        # lengths are read on the device. Not under TRITON_INTERPRET=1: the
        # interpreter runs each kernel as Python over host arrays, which no
        # graph records (a CPU graph would only find that out at capture).
        return os.environ.get("TRITON_INTERPRET") != "1"

    @classmethod
    def supports_uniform_query_capture(cls, block_size: int) -> bool:
        # unified_attention's launch depends on num_reqs and max_query_len
        # alone (q, fixed per verify graph); each row's causal bound is
        # read from seq_lens and query_start_loc on the device.
        return cls.supports_graph_capture(block_size)

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> TritonMetadata:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        num_segments = choose_num_segments(common.num_reqs, common.max_query_len, common.max_seq_len)
        return TritonMetadata(**fields, num_segments=num_segments)
