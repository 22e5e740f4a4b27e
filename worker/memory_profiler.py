"""The profile run: one forward of the largest batch the scheduler can send.

A device that sizes its KV cache from free memory (CUDA) must leave room for
the activations of that batch; it measures their peak around this run
(`Platform.kv_cache_budget_bytes`). The run uses a throwaway KV cache just
large enough for its one request and unbinds it afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


@torch.inference_mode()
def profile_run(
    model: torch.nn.Module,
    attn_backend: type[AttentionBackend],
    *,
    num_tokens: int,
    num_logit_rows: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Prefill `num_tokens` tokens of one request, then compute logits for
    `num_logit_rows` rows (the sampler's largest batch)."""
    num_blocks = -(-num_tokens // block_size)
    shape = attn_backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    layers = model.get_attention_layers()
    for layer in layers:
        layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    try:
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
        common = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=1,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_start_loc=query_start_loc.to(device),
            seq_lens=seq_lens.to(device),
            block_table=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        hidden_states = model(
            torch.zeros(num_tokens, dtype=torch.long, device=device),
            torch.arange(num_tokens, device=device),
            attn_backend.build_metadata(common, block_size),
        )
        rows = torch.arange(min(num_logit_rows, num_tokens), device=device)
        model.compute_logits(hidden_states[rows]).float().softmax(dim=-1)
    finally:
        for layer in layers:
            layer.kv_cache = None
