"""Paged KV cache: block pool, chained block hashes, and the manager."""

from __future__ import annotations

from pagedllm.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache.hashing import (
    ROOT_BLOCK_HASH,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
)
from pagedllm.core.kv_cache.manager import KVCacheInvariantError, KVCacheManager, PrefixCacheStats
from pagedllm.core.request import BlockHash

__all__ = [
    "ROOT_BLOCK_HASH",
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheInvariantError",
    "KVCacheManager",
    "PrefixCacheStats",
    "get_hash_fn",
    "get_request_block_hasher",
    "hash_block_tokens",
]
