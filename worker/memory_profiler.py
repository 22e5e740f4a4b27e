"""The profile run: one forward of the largest batch the scheduler can send.

A device that sizes its KV cache from free memory (CUDA) must leave room for
the activations of that batch; it measures their peak around this run
(`Platform.kv_cache_budget_bytes`). The run uses a throwaway KV cache just
large enough for its one request and unbinds it afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.kv_cache import allocate_kv_caches, unbind_kv_caches

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.model_registry.interface import ModelForCausalLM


@torch.inference_mode()
def profile_run(
    model: ModelForCausalLM,
    attn_backend: type[AttentionBackend],
    *,
    num_tokens: int,
    num_logit_rows: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Prefill `num_tokens` tokens of one request, then compute logits for
    `num_logit_rows` rows (the sampler's largest batch)."""
    num_blocks = -(-num_tokens // block_size)
    allocate_kv_caches(
        model, attn_backend, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=kv_cache_dtype, device=device,
    )
    try:
        batch = InputBatch.from_computed(
            np.zeros(1, dtype=np.int64), np.array([num_tokens], dtype=np.int64),
            np.arange(num_blocks, dtype=np.int32)[None, :], block_size,
        )
        positions, attn_metadata = batch.to_device(attn_backend, block_size, device)
        hidden_states = model(torch.zeros(num_tokens, dtype=torch.long, device=device), positions, attn_metadata)
        rows = torch.arange(min(num_logit_rows, num_tokens), device=device)
        model.compute_logits(hidden_states[rows]).float().softmax(dim=-1)
    finally:
        unbind_kv_caches(model)
