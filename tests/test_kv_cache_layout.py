"""The KV cache layout has one owner: built-in backends inherit the standard
layout, a backend with another layout inherits its shape, a 1.0 backend's
own shape is classified, and KV connectors move blocks through the layout,
so blocks travel unchanged between caches laid out differently. Every
expectation indexes the caches by hand, token by token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedllm.attention_backends.base import (
    STANDARD_KV_CACHE_LAYOUT,
    AttentionBackend,
    KVCacheLayout,
    UndeclaredKVCacheLayout,
)
from pagedllm.core.config import KVTransferConfig
from pagedllm.core.errors import AttentionBackendError
from pagedllm.kv_connectors.base import KVConnectorContext
from pagedllm.kv_connectors.block_io import gather_blocks, scatter_blocks

BLOCK_SIZE = 16
NUM_BLOCKS = 8
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 8
SIZES = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)


class TokenMajorLayout(KVCacheLayout):
    """[num_blocks, block_size, 2, Hkv, D]: each token's K and V side by side."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, 2, num_kv_heads, head_size)

    def gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return kv_cache.index_select(0, block_ids).transpose(1, 2)

    def scatter_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        kv_cache.index_copy_(0, block_ids, blocks.transpose(1, 2))


TOKEN_MAJOR = TokenMajorLayout()


class TokenMajorBackend(AttentionBackend):
    """Declares its layout (plugin API 1.2); only the layout matters here."""

    name = "token_major"

    @classmethod
    def get_kv_cache_layout(cls) -> KVCacheLayout:
        return TOKEN_MAJOR


def _standard_kv(cache: torch.Tensor, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[0, block, offset], cache[1, block, offset]


def _token_major_kv(cache: torch.Tensor, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[block, offset, 0], cache[block, offset, 1]


# (one layer's cache, block, offset) -> that token's (K, V), indexed by hand.
KVAt = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def _random_caches(layout: KVCacheLayout, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.kv_cache_shape(*SIZES), generator=generator) for _ in range(NUM_LAYERS)]


def _zero_caches(layout: KVCacheLayout) -> list[torch.Tensor]:
    return [torch.zeros(layout.kv_cache_shape(*SIZES)) for _ in range(NUM_LAYERS)]


def _assert_same_tokens(
    src: list[torch.Tensor], src_blocks: list[int], dst: list[torch.Tensor], dst_blocks: list[int],
    src_kv: KVAt = _standard_kv, dst_kv: KVAt = _token_major_kv,
) -> None:
    for layer in range(NUM_LAYERS):
        for src_block, dst_block in zip(src_blocks, dst_blocks, strict=True):
            for offset in range(BLOCK_SIZE):
                src_k, src_v = src_kv(src[layer], src_block, offset)
                dst_k, dst_v = dst_kv(dst[layer], dst_block, offset)
                assert torch.equal(dst_k, src_k) and torch.equal(dst_v, src_v), (layer, src_block, offset)


def _context(layout: KVCacheLayout) -> KVConnectorContext:
    return KVConnectorContext(
        model_path="unused", model_fingerprint="layout-test", block_size=BLOCK_SIZE, num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32, device=torch.device("cpu"),
        kv_cache_layout=layout,
    )


def _request(block_hashes: list[bytes], num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", num_tokens=num_tokens, num_prompt_tokens=num_tokens,
                           num_computed_tokens=0, block_hashes=block_hashes)


def _step(num_scheduled_tokens: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(scheduled_cached_reqs=[], num_scheduled_tokens=num_scheduled_tokens)


# ------------------------------------------------------------ who owns it


@pytest.mark.parametrize("module, cls_name", [
    ("pagedllm.attention_backends.torch_native", "TorchNativeBackend"),
    ("pagedllm.attention_backends.triton.backend", "TritonBackend"),
    ("pagedllm.attention_backends.flash_attn", "FlashAttentionBackend"),
])
def test_builtin_backends_inherit_the_standard_layout_and_its_shape(module: str, cls_name: str) -> None:
    import importlib

    backend = getattr(importlib.import_module(module), cls_name)
    assert "get_kv_cache_shape" not in vars(backend)  # no copy of the layout
    assert backend.get_kv_cache_layout() is STANDARD_KV_CACHE_LAYOUT
    assert backend.get_kv_cache_shape(5, 16, 3, 64) == (2, 5, 16, 3, 64)


def test_a_backend_with_its_own_layout_inherits_that_layouts_shape() -> None:
    assert TokenMajorBackend.get_kv_cache_shape(5, 16, 3, 64) == (5, 16, 2, 3, 64)


def test_a_1_0_backend_that_overrides_only_the_standard_shape_has_the_standard_layout() -> None:
    class StandardShapeBackend(AttentionBackend):
        name = "standard_shape_1_0"

        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
            return (2, num_blocks, block_size, num_kv_heads, head_size)

    assert StandardShapeBackend.get_kv_cache_layout() is STANDARD_KV_CACHE_LAYOUT


def test_a_1_0_backend_with_another_shape_runs_but_a_connector_refuses_it(tmp_path: Path) -> None:
    from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
    from pagedllm.kv_connectors.shared_storage import SharedStorageConnector

    class HeadMajorBackend(AttentionBackend):
        name = "head_major_1_0"

        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
            return (2, num_blocks, num_kv_heads, block_size, head_size)

    layout = HeadMajorBackend.get_kv_cache_layout()
    assert isinstance(layout, UndeclaredKVCacheLayout)
    assert layout.kv_cache_shape(5, 16, 3, 64) == (2, 5, 3, 16, 64)  # its caches are allocated as before
    cache = torch.zeros(layout.kv_cache_shape(*SIZES))
    with pytest.raises(AttentionBackendError, match=r"'head_major_1_0'.*declares no get_kv_cache_layout"):
        gather_blocks([cache], [0], layout)
    with pytest.raises(AttentionBackendError, match="head_major_1_0"):
        scatter_blocks([cache], [0], torch.zeros(1, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), layout)
    with pytest.raises(AttentionBackendError, match="head_major_1_0"):
        CpuOffloadConnector(KVTransferConfig(connector="cpu_offload"), _context(layout))
    storage = KVTransferConfig(connector="shared_storage", extra={"path": str(tmp_path)})
    with pytest.raises(AttentionBackendError, match="head_major_1_0"):
        SharedStorageConnector(storage, _context(layout))


# ------------------------------------------------------- blocks through it


def test_blocks_keep_every_tokens_kv_between_caches_of_different_layouts() -> None:
    standard = _random_caches(STANDARD_KV_CACHE_LAYOUT, seed=0)
    blocks = gather_blocks(standard, [3, 0])  # the default layout is the standard one
    assert blocks.shape == (2, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    for index, block in enumerate([3, 0]):
        for layer in range(NUM_LAYERS):
            assert torch.equal(blocks[index, layer, 0], standard[layer][0, block])
            assert torch.equal(blocks[index, layer, 1], standard[layer][1, block])

    token_major = _zero_caches(TOKEN_MAJOR)
    scatter_blocks(token_major, [1, 4], blocks, TOKEN_MAJOR)
    _assert_same_tokens(standard, [3, 0], token_major, [1, 4])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 4)]
    assert all(not cache[untouched].any() for cache in token_major)
    assert torch.equal(gather_blocks(token_major, [1, 4], TOKEN_MAJOR), blocks)

    back = _zero_caches(STANDARD_KV_CACHE_LAYOUT)
    scatter_blocks(back, [6, 2], gather_blocks(token_major, [1, 4], TOKEN_MAJOR))
    _assert_same_tokens(token_major, [1, 4], back, [6, 2], src_kv=_token_major_kv, dst_kv=_standard_kv)


def test_shared_storage_carries_blocks_from_a_standard_cache_into_a_token_major_one(tmp_path: Path) -> None:
    from pagedllm.kv_connectors.shared_storage import SharedStorageConnector

    hashes = [bytes([i]) * 32 for i in range(3)]
    num_tokens = 3 * BLOCK_SIZE + 1
    producer = SharedStorageConnector(
        KVTransferConfig(connector="shared_storage", role="producer", extra={"path": str(tmp_path)}),
        _context(STANDARD_KV_CACHE_LAYOUT),
    )
    producer.register_kv_caches(_random_caches(STANDARD_KV_CACHE_LAYOUT, seed=1))
    producer.update_state_after_alloc(_request(hashes, num_tokens), [2, 5, 7, 1], 0)
    producer.start_load_kv(producer.build_connector_meta(_step({"r": num_tokens})))
    producer.wait_for_save()
    assert sorted(p.name for p in producer.directory.iterdir()) == sorted(f"{h.hex()}.safetensors" for h in hashes)

    consumer = SharedStorageConnector(
        KVTransferConfig(connector="shared_storage", role="consumer", extra={"path": str(tmp_path)}),
        _context(TOKEN_MAJOR),
    )
    consumer.register_kv_caches(_zero_caches(TOKEN_MAJOR))
    request = _request(hashes, num_tokens)
    assert consumer.get_num_new_matched_tokens(request, 0) == 3 * BLOCK_SIZE
    consumer.update_state_after_alloc(request, [6, 0, 3, 4], 3 * BLOCK_SIZE)
    consumer.start_load_kv(consumer.build_connector_meta(_step({})))
    _assert_same_tokens(producer.kv_caches, [2, 5, 7], consumer.kv_caches, [6, 0, 3])


def test_cpu_offload_spills_and_reloads_blocks_of_a_token_major_cache() -> None:
    from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector

    connector = CpuOffloadConnector(KVTransferConfig(connector="cpu_offload"), _context(TOKEN_MAJOR))
    original = _random_caches(TOKEN_MAJOR, seed=2)
    connector.register_kv_caches([cache.clone() for cache in original])
    hashes = [b"\x01" * 32, b"\x02" * 32]
    connector.on_blocks_evicted([(4, hashes[0]), (1, hashes[1])])
    connector.start_load_kv(connector.build_connector_meta(_step({})))
    # The tier holds blocks in the transport form, whatever the cache's layout.
    for block, block_hash in zip([4, 1], hashes, strict=True):
        stored = connector.blocks.get(block_hash)
        assert stored is not None
        for layer in range(NUM_LAYERS):
            assert torch.equal(stored[layer, 0], original[layer][block, :, 0])
            assert torch.equal(stored[layer, 1], original[layer][block, :, 1])

    for cache in connector.kv_caches:  # the evicted blocks' slots are reused
        cache.zero_()
    request = _request(hashes, 2 * BLOCK_SIZE + 1)
    assert connector.get_num_new_matched_tokens(request, 0) == 2 * BLOCK_SIZE
    connector.update_state_after_alloc(request, [2, 6, 0], 2 * BLOCK_SIZE)
    connector.start_load_kv(connector.build_connector_meta(_step({})))
    _assert_same_tokens(original, [4, 1], connector.kv_caches, [2, 6], src_kv=_token_major_kv)
