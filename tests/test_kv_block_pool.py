from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.core.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from pagedllm.core.request import Request

HASHER = get_request_block_hasher(4, get_hash_fn("sha256"))


def make_hashed_request(request_id: str, token_ids: list[int]) -> Request:
    params = SimpleNamespace(prompt_logprobs=None, structured_outputs=None)
    request = Request(request_id, token_ids, params, eos_token_id=None)
    HASHER(request)
    return request


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def test_queue_popleft_remove_from_middle_and_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    queue.append(blocks[2])
    queue.append_n([blocks[0]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 2, 0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 3]
    assert queue.num_free_blocks == 3


def test_queue_rejects_misuse() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="cannot pop 3"):
        queue.popleft_n(3)
    assert queue.num_free_blocks == 2
    queue.popleft_n(2)
    with pytest.raises(ValueError, match="no free"):
        queue.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])


def test_pool_starts_free_in_id_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 6 and pool.get_usage() == 0.0


def test_get_new_blocks_pops_head_and_refuses_over_capacity() -> None:
    pool = BlockPool(4, enable_caching=True)
    new_blocks = pool.get_new_blocks(3)
    assert [(b.block_id, b.ref_cnt) for b in new_blocks] == [(0, 1), (1, 1), (2, 1)]
    assert pool.get_usage() == 0.75
    with pytest.raises(ValueError, match="cannot allocate 2 blocks; only 1"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [3]


def test_free_blocks_appends_in_given_order_when_ref_reaches_zero() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.touch([blocks[1]])  # shared by a second table
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 0]
    assert blocks[1].ref_cnt == 1
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [3, 4, 2, 0, 1]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blocks[1]])


def test_touch_revives_a_free_block_from_the_middle() -> None:
    pool = BlockPool(5, enable_caching=True)
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert free_ids(pool) == [0, 1, 3, 4]


def test_cache_full_blocks_registers_hashes_and_keeps_first_duplicate() -> None:
    pool = BlockPool(6, enable_caching=True)
    owner = make_hashed_request("a", list(range(10)))
    owner_blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(owner, owner_blocks, 0, 2)
    assert [b.block_hash for b in owner_blocks] == [owner.block_hashes[0], owner.block_hashes[1], None]
    assert pool.get_cached_block(owner.block_hashes[1]) is owner_blocks[1]

    twin = make_hashed_request("b", list(range(8)))
    twin_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(twin, twin_blocks, 0, 2)
    # Same content computed twice: the first block stays the cached one.
    assert pool.get_cached_block(twin.block_hashes[0]) is owner_blocks[0]
    assert [b.block_hash for b in twin_blocks] == [None, None]
    assert len(pool.cached_block_hash_to_block) == 2

    with pytest.raises(ValueError, match="has 2 block hashes, cannot cache 3"):
        pool.cache_full_blocks(owner, owner_blocks, 2, 3)


def test_freed_block_keeps_hash_until_reallocated() -> None:
    pool = BlockPool(2, enable_caching=True)
    request = make_hashed_request("a", list(range(4)))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], 0, 1)
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 0]
    # Lazy invalidation: still hittable while it waits in the free queue.
    assert pool.get_cached_block(request.block_hashes[0]) is block
    assert pool.get_new_blocks(1)[0].block_id == 1
    assert pool.get_cached_block(request.block_hashes[0]) is block
    reused = pool.get_new_blocks(1)[0]
    assert reused is block and block.block_hash is None
    assert pool.get_cached_block(request.block_hashes[0]) is None


def test_evict_drops_blocks_from_the_cache_only() -> None:
    pool = BlockPool(3, enable_caching=True)
    request = make_hashed_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.evict([1, 2]) == 1
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert blocks[1].ref_cnt == 1


def test_reset_prefix_cache_refuses_while_blocks_are_used() -> None:
    pool = BlockPool(3, enable_caching=True)
    request = make_hashed_request("a", list(range(4)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None
