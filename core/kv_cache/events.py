"""KV cache events: what a replica's prefix cache gained and lost, step by
step, so that a router can mirror which block hashes each replica holds
(vLLM's KV events; SGLang's router mirrors a radix tree the same way).

Events are msgspec structs that ride on the engine core's step outputs
(engine/wire.py). A hash is the prefix cache's block hash (core/kv_cache/
hashing.py): a router that hashes a prompt's full blocks the same way (same
block size, algorithm and salt) can tell how long a prefix a replica holds.
Consecutive events of one kind are merged, so a step's events stay compact.
"""

from __future__ import annotations

import msgspec

from pagedllm.core.request import BlockHash


class BlockStored(msgspec.Struct, tag="stored", array_like=True):
    """These hashes became hittable (a computed full block registered)."""

    block_hashes: list[bytes]


class BlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    """These hashes are no longer hittable (their block was reused or dropped)."""

    block_hashes: list[bytes]


class AllBlocksCleared(msgspec.Struct, tag="cleared", array_like=True):
    """The prefix cache was reset: nothing is hittable."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """The events since the last `take()`, in order, runs of a kind merged."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hash: BlockHash) -> None:
        self._add(BlockStored, block_hash)

    def removed(self, block_hash: BlockHash) -> None:
        self._add(BlockRemoved, block_hash)

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before no longer matters

    def _add(self, kind: type[BlockStored] | type[BlockRemoved], block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, kind):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(kind([block_hash]))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "KVEventRecorder"]
