"""The worker's one batch description (InputBatch) and KV cache allocation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.model_registry.kv_cache import allocate_kv_caches, unbind_kv_caches


def test_a_step_of_a_decode_and_a_prefill_chunk_maps_every_row_to_its_slot() -> None:
    # Request 0 has 3 tokens computed and computes 2 more; request 1 prefills 3.
    block_table = np.array([[7, 4, 9], [5, 1, 0]], dtype=np.int32)
    batch = InputBatch.from_computed(np.array([3, 0]), np.array([2, 3]), block_table, block_size=2)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 2, 5])
    np.testing.assert_array_equal(batch.positions, [3, 4, 0, 1, 2])
    np.testing.assert_array_equal(batch.seq_lens, [5, 3])
    np.testing.assert_array_equal(batch.num_computed_tokens, [3, 0])
    # position p of a request -> block_table[p // 2] * 2 + p % 2
    np.testing.assert_array_equal(batch.slot_mapping, [4 * 2 + 1, 9 * 2 + 0, 5 * 2 + 0, 5 * 2 + 1, 1 * 2 + 0])
    assert (batch.num_reqs, batch.num_tokens) == (2, 5)


def test_draft_steps_at_given_positions_end_each_context_there() -> None:
    batch = InputBatch.from_positions(
        np.array([10, 4]), np.ones(2, dtype=np.int64), np.array([[0, 0, 3, 6, 8, 2], [5, 7, 0, 0, 0, 0]]), 4
    )
    np.testing.assert_array_equal(batch.seq_lens, [11, 5])
    np.testing.assert_array_equal(batch.slot_mapping, [3 * 4 + 2, 7 * 4 + 0])


def test_attention_metadata_carries_the_batch_in_the_backends_dtypes() -> None:
    block_table = np.array([[7, 4, 9], [5, 1, 0]], dtype=np.int32)
    batch = InputBatch.from_computed(np.array([3, 0]), np.array([2, 3]), block_table, 2)
    positions, metadata = batch.to_device(TorchNativeBackend, 2, torch.device("cpu"))
    assert positions.tolist() == [3, 4, 0, 1, 2] and positions.dtype == torch.int64
    assert (metadata.num_actual_tokens, metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len) == (5, 2, 3, 5)
    assert metadata.query_start_loc.tolist() == [0, 2, 5] and metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens_cpu.tolist() == [5, 3] and metadata.seq_lens.dtype == torch.int32
    assert metadata.block_table.tolist() == [[7, 4, 9], [5, 1, 0]] and metadata.block_table.dtype == torch.int32
    assert metadata.slot_mapping.tolist() == [9, 18, 10, 11, 2] and metadata.slot_mapping.dtype == torch.int64


def test_kv_caches_are_allocated_per_layer_bound_and_unbound() -> None:
    layers = [SimpleNamespace(kv_cache=None, num_kv_heads=2), SimpleNamespace(kv_cache=None, num_kv_heads=2)]
    model = SimpleNamespace(get_attention_layers=lambda: layers)
    kv_caches = allocate_kv_caches(
        model, TorchNativeBackend, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8,
        dtype=torch.float16, device=torch.device("cpu"),
    )
    assert len(kv_caches) == 2 and kv_caches[0] is not kv_caches[1]
    assert all(layer.kv_cache is kv for layer, kv in zip(layers, kv_caches, strict=True))
    assert kv_caches[0].shape == TorchNativeBackend.get_kv_cache_shape(5, 4, 2, 8)
    assert kv_caches[0].dtype == torch.float16
    assert not kv_caches[0].any()
    unbind_kv_caches(model)
    assert all(layer.kv_cache is None for layer in layers)
