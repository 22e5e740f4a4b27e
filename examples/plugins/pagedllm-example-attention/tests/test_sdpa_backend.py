"""The sdpa backend: found through this package's entry point, and equal to
pagedllm's torch_native backend on a batch mixing a decode, a whole prompt and
a prompt chunk after cached context."""

from __future__ import annotations

import importlib.metadata

import torch

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.plugins import PluginManager

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 16


def mixed_batch(generator: torch.Generator) -> AttentionMetadata:
    """Three requests as (context after this step, new tokens): a decode, a
    whole prompt, and a 4-token chunk after 8 cached tokens; shuffled blocks."""
    shapes = [(5, 1), (7, 7), (12, 4)]
    block_tables = [[9, 2], [4, 0], [7, 1, 11]]
    slots, query_start_loc = [], [0]
    for (seq_len, query_len), blocks in zip(shapes, block_tables):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + query_len)
    width = max(map(len, block_tables))
    table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    starts = torch.tensor(query_start_loc, dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in shapes], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        num_reqs=len(shapes),
        max_query_len=max(q for _, q in shapes),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def run_backend(backend: type, metadata: AttentionMetadata, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_tokens = metadata.num_actual_tokens
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    # Cached context: whatever an earlier step left in the pool.
    kv_cache = torch.randn(backend.get_kv_cache_shape(12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), generator=generator)
    impl = backend.get_impl_cls()(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS)
    out = impl.forward(q, k, v, kv_cache, backend.build_metadata(metadata, BLOCK_SIZE))
    return out, kv_cache


def test_sdpa_is_registered_through_the_entry_point() -> None:
    pm = PluginManager()
    pm.load(strict=True)
    registration = pm.registry("attention_backend").get("sdpa")
    assert registration.source == f"pagedllm-example-attention {importlib.metadata.version('pagedllm-example-attention')}"
    assert registration.metadata["supports_sliding_window"] is False


def test_sdpa_equals_torch_native_on_a_mixed_batch() -> None:
    from pagedllm_example_attention.sdpa import SdpaBackend

    metadata = mixed_batch(torch.Generator().manual_seed(0))
    sdpa_out, sdpa_cache = run_backend(SdpaBackend, metadata)
    native_out, native_cache = run_backend(TorchNativeBackend, metadata)
    torch.testing.assert_close(sdpa_out, native_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(sdpa_cache, native_cache)  # same K/V written at the same slots
