"""Batch building shared by the model drafters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


def build_attn_metadata(
    attn_backend: type[AttentionBackend],
    block_size: int,
    positions: np.ndarray,
    query_lens: np.ndarray,
    block_table: np.ndarray,
    device: torch.device,
) -> object:
    """Attention metadata of a flattened batch whose request r has query_lens[r]
    rows at consecutive positions (ending at its context length)."""
    num_reqs = len(query_lens)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    req_index = np.repeat(np.arange(num_reqs), query_lens)
    seq_lens = positions[query_start_loc[1:] - 1] + 1
    slot_mapping = (
        block_table[req_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    query_start_loc_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    common = AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        num_reqs=num_reqs,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=query_start_loc_cpu.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    return attn_backend.build_metadata(common, block_size)


def bind_kv_caches(model: torch.nn.Module, context: object) -> list[torch.Tensor]:
    """A KV cache per attention layer of `model`, with the target's block
    geometry (num_blocks, block_size): the same block ids address both."""
    attn_layers = model.get_attention_layers()  # type: ignore[operator]
    caches = []
    for layer in attn_layers:
        shape = context.attn_backend.get_kv_cache_shape(  # type: ignore[attr-defined]
            context.num_blocks, context.block_size, layer.num_kv_heads, layer.head_size  # type: ignore[attr-defined]
        )
        cache = torch.zeros(shape, dtype=context.dtype, device=context.device)  # type: ignore[attr-defined]
        layer.kv_cache = cache
        caches.append(cache)
    return caches
