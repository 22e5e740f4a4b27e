"""An outside view of a KVCacheManager, for the state-machine tests.

`KVReference` mirrors every block table from what its caller was told (the
blocks allocate_slots returned, the block ids a SchedulerOutput carried) and
remembers, for each block, which request and table position it was last
freshly allocated for and how many of its slots were computed since. `check()`
then compares the manager's own state with that record: ref counts, the free
queue's links, the hash table, and what each shared block holds. Only the
first step of `check()` trusts the manager (its own debug checker, reused);
everything after it is recomputed from the outside.

A block's *content* is (cache salt, every token up to the end of the block):
two requests may share a block only if their contents there are equal, so a
block is never shared across different salts, and a prefix hit never serves
tokens the request does not have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.manager import KVCacheManager
    from pagedllm.core.request import BlockHash, Request

Content = tuple[str | None, tuple[int, ...]]


def content_of(request: Request, index: int, block_size: int) -> Content | None:
    """What block `index` of `request` holds once full; None while it is not."""
    end = (index + 1) * block_size
    if request.num_tokens < end:
        return None
    return request.cache_salt, tuple(request.all_token_ids[:end])


@dataclass
class BlockOrigin:
    """The request and table position a block was last freshly allocated for."""

    request: Request
    index: int
    # Slots computed by that request since the allocation (written in order).
    num_written: int = 0


class KVReference:
    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.tables: dict[str, list[int]] = {}
        self.live: dict[str, Request] = {}
        self.origins: dict[int, BlockOrigin] = {}
        # Every block hash any request produced, with the content it names.
        self.hash_contents: dict[BlockHash, Content] = {}
        self._known: dict[str, Request] = {}
        self._num_hashes_seen: dict[str, int] = {}

    # ------------------------------------------------------------ events

    def on_allocated(self, request: Request, hit_block_ids: Iterable[int], new_block_ids: Iterable[int]) -> None:
        """`request` took these prefix-hit blocks, then these fresh blocks."""
        self.on_step_allocated([(request, list(hit_block_ids), list(new_block_ids))])

    def on_step_allocated(self, allocations: list[tuple[Request, list[int], list[int]]]) -> None:
        """Several requests' allocations of one scheduler step, in any order.

        NOTE: a request admitted later in a step may hit a block allocated
        (and cached) earlier in the same step; both compute it in that step.
        So every fresh block of the step is checked against the tables from
        before the step, and hits are added after.
        """
        fresh_block_ids: set[int] = set()
        for request, hit_block_ids, new_block_ids in allocations:
            table = self.tables.get(request.request_id, [])
            assert not (hit_block_ids and table), f"{request.request_id}: prefix hit on a request with blocks"
            first_new_index = len(table) + len(hit_block_ids)
            for offset, block_id in enumerate(new_block_ids):
                holders = [other for other, blocks in self.tables.items() if block_id in blocks]
                assert not holders and block_id not in fresh_block_ids, (
                    f"fresh block {block_id} given to {request.request_id} is still held by "
                    f"{holders or 'another request of this step'}"
                )
                fresh_block_ids.add(block_id)
                self.origins[block_id] = BlockOrigin(request, first_new_index + offset)
        for request, hit_block_ids, new_block_ids in allocations:
            table = self.tables.setdefault(request.request_id, [])
            table.extend(hit_block_ids)
            table.extend(new_block_ids)
            self.live[request.request_id] = request
            self._known[request.request_id] = request

    def on_computed(self, request: Request, start: int, end: int) -> None:
        """The model wrote the K/V of positions [start, end) of `request`."""
        table = self.tables[request.request_id]
        for position in range(start, end):
            index = position // self.block_size
            assert index < len(table), f"{request.request_id}: position {position} has no block"
            origin = self.origins.get(table[index])
            assert origin is not None and origin.request is request and origin.index == index, (
                f"{request.request_id} writes position {position} into block {table[index]}, "
                "which it does not own (a prefix-cache hit or another request's block)"
            )
            assert origin.num_written == position % self.block_size, (
                f"{request.request_id}: block {table[index]} written out of order at position {position}"
            )
            origin.num_written += 1

    def on_freed(self, request_id: str) -> None:
        self.tables.pop(request_id, None)
        self.live.pop(request_id, None)

    # ------------------------------------------------------------ queries

    def free_block_ids(self) -> list[int]:
        """The free queue head to tail, walked forward; its links checked both ways."""
        queue = self.manager.block_pool.free_block_queue
        block_ids: list[int] = []
        prev_block = queue.fake_head
        block = queue.fake_head.next_free_block
        while block is not queue.fake_tail:
            assert block is not None, "the free queue's forward links end before the tail"
            assert block.prev_free_block is prev_block, f"free block {block.block_id}: prev link broken"
            assert len(block_ids) < self.manager.num_blocks, "the free queue's forward links loop"
            block_ids.append(block.block_id)
            prev_block, block = block, block.next_free_block
        assert queue.fake_tail.prev_free_block is prev_block, "the free queue's tail link is broken"
        assert len(block_ids) == queue.num_free_blocks, (
            f"free queue holds {len(block_ids)} blocks but counts {queue.num_free_blocks}"
        )
        return block_ids

    def expected_hit_blocks(self, request: Request) -> int:
        """Leading blocks of `request` whose content some cached block holds."""
        cached_contents = {
            self._content(block.block_id) for block in self.manager.block_pool.blocks if block.block_hash is not None
        }
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        num_hit_blocks = 0
        while (
            num_hit_blocks < max_hit_blocks
            and content_of(request, num_hit_blocks, self.block_size) in cached_contents
        ):
            num_hit_blocks += 1
        return num_hit_blocks

    # --------------------------------------------------------- invariants

    def check(self) -> None:
        # The manager's own debug checker first (the PAGEDLLM_DEBUG_KV=1 one) ...
        self.manager.check_invariants(self.live.values())
        # ... then everything again from the outside.
        self._record_hashes()
        self._check_tables_and_ref_counts()
        self._check_hash_table()
        self._check_live_contents()

    def _content(self, block_id: int) -> Content | None:
        origin = self.origins.get(block_id)
        if origin is None:
            return None
        return content_of(origin.request, origin.index, self.block_size)

    def _record_hashes(self) -> None:
        for request_id, request in self._known.items():
            start = self._num_hashes_seen.get(request_id, 0)
            for index in range(start, len(request.block_hashes)):
                content = content_of(request, index, self.block_size)
                assert content is not None, f"{request_id}: hash of block {index}, which is not full"
                seen = self.hash_contents.setdefault(request.block_hashes[index], content)
                assert seen == content, (
                    f"one block hash names two contents: salt {seen[0]!r} tokens {seen[1]} "
                    f"and salt {content[0]!r} tokens {content[1]}"
                )
            self._num_hashes_seen[request_id] = len(request.block_hashes)

    def _check_tables_and_ref_counts(self) -> None:
        manager = self.manager
        pool = manager.block_pool
        assert set(manager.req_to_blocks) == set(self.tables), (
            f"manager holds tables of {sorted(manager.req_to_blocks)}, expected {sorted(self.tables)}"
        )
        for request_id, table in self.tables.items():
            assert manager.get_block_ids(request_id) == table, (
                f"{request_id}: block table {manager.get_block_ids(request_id)}, expected {table}"
            )
            assert len(set(table)) == len(table), f"{request_id}: a block twice in one table: {table}"
        expected_refs = [0] * manager.num_blocks
        for table in self.tables.values():
            for block_id in table:
                expected_refs[block_id] += 1
        actual_refs = [block.ref_cnt for block in pool.blocks]
        assert actual_refs == expected_refs, f"ref counts {actual_refs}, live tables give {expected_refs}"

        free_ids = self.free_block_ids()
        assert len(set(free_ids)) == len(free_ids), f"a block twice in the free queue: {free_ids}"
        in_use = [block_id for block_id, refs in enumerate(expected_refs) if refs > 0]
        assert not set(free_ids) & set(in_use), f"blocks both free and referenced: {set(free_ids) & set(in_use)}"
        assert len(free_ids) + len(in_use) == manager.num_blocks, (
            f"free ({len(free_ids)}) + used ({len(in_use)}) != total ({manager.num_blocks})"
        )
        for block_id in in_use:
            block = pool.blocks[block_id]
            assert block.prev_free_block is None and block.next_free_block is None, (
                f"used block {block_id} still has free-queue links"
            )
        assert manager.num_free_blocks == len(free_ids)
        assert manager.usage == 1.0 - len(free_ids) / manager.num_blocks

    def _check_hash_table(self) -> None:
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                f"hash-table entry points to block {block.block_id} under another hash"
            )
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            assert pool.cached_block_hash_to_block.get(block.block_hash) is block, (
                f"block {block.block_id} has a hash but is not findable under it"
            )
            origin = self.origins.get(block.block_id)
            assert origin is not None, f"block {block.block_id} is cached but was never allocated"
            assert origin.num_written == self.block_size, (
                f"block {block.block_id} is cached (hittable) with only {origin.num_written} of "
                f"{self.block_size} slots computed"
            )
            assert block.block_hash in self.hash_contents, f"block {block.block_id}: hash no request produced"
            hashed_content = self.hash_contents[block.block_hash]
            held_content = self._content(block.block_id)
            assert hashed_content == held_content, (
                f"block {block.block_id} is cached under the hash of salt {hashed_content[0]!r} "
                f"tokens {hashed_content[1]} but holds {held_content}"
            )

    def _check_live_contents(self) -> None:
        block_size = self.block_size
        salts_by_block: dict[int, set[str | None]] = {}
        for request_id, table in self.tables.items():
            request = self.live[request_id]
            num_computed = request.num_computed_tokens
            assert len(table) * block_size >= num_computed, (
                f"{request_id}: {num_computed} computed tokens but {len(table)} blocks of {block_size}"
            )
            for index, block_id in enumerate(table):
                salts_by_block.setdefault(block_id, set()).add(request.cache_salt)
                origin = self.origins[block_id]
                owned = origin.request is request and origin.index == index
                num_computed_here = min(block_size, max(0, num_computed - index * block_size))
                if owned:
                    assert origin.num_written == num_computed_here, (
                        f"{request_id}: block {block_id} has {origin.num_written} slots written, "
                        f"{num_computed_here} computed"
                    )
                    continue
                # Borrowed (a prefix hit): someone else computed all of it.
                assert content_of(request, index, block_size) == self._content(block_id), (
                    f"{request_id} (salt {request.cache_salt!r}) shares block {block_id} at index {index}, "
                    f"which holds {self._content(block_id)}"
                )
                assert origin.num_written == block_size, f"{request_id}: borrowed block {block_id} is not computed"
        for block_id, salts in salts_by_block.items():
            assert len(salts) == 1, f"block {block_id} is shared across cache salts {salts}"
