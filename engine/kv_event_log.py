"""The server's record of which block hashes its prefix cache holds, for a
router in front of several servers (`pagedllm router`, GET /v1/kv_events).

Every replica (one engine, or each of `-dp N`) reports the hashes its cache
gains and loses (core/kv_cache/events.py). The log keeps, per replica, what
it holds, and numbers the server-level changes: a hash is "stored" when the
first replica gains it and "removed" when the last one loses it. A reader
asks for the changes after the last number it saw; one that fell behind the
kept window (or asks for the first time) gets a snapshot instead.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from pagedllm.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# Changes kept for incremental readers; one further behind gets a snapshot.
DEFAULT_WINDOW = 65536


class KVEventLog:
    def __init__(self, num_replicas: int, *, block_size: int, hash_algo: str, window: int = DEFAULT_WINDOW) -> None:
        self.block_size = block_size
        self.hash_algo = hash_algo
        self._held: list[set[bytes]] = [set() for _ in range(num_replicas)]
        self._holders: Counter[bytes] = Counter()  # hash -> replicas holding it
        self._changes: deque[tuple[int, str, bytes]] = deque(maxlen=window)
        self.seq = 0  # the number of the latest change

    def apply(self, replica: int, events: Iterable[KVCacheEvent]) -> None:
        held = self._held[replica]
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    if block_hash not in held:
                        held.add(block_hash)
                        self._count(block_hash, +1)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in held:
                        held.discard(block_hash)
                        self._count(block_hash, -1)
            elif isinstance(event, AllBlocksCleared):
                for block_hash in sorted(held):
                    self._count(block_hash, -1)
                held.clear()

    def _count(self, block_hash: bytes, delta: int) -> None:
        before = self._holders[block_hash]
        after = before + delta
        if after:
            self._holders[block_hash] = after
        else:
            del self._holders[block_hash]
        if before == 0 or after == 0:
            self.seq += 1
            self._changes.append((self.seq, "stored" if after else "removed", block_hash))

    def read(self, after: int | None) -> dict[str, Any]:
        """The changes after `after` (hashes in hex), or a snapshot of every
        hash held when `after` is None, in the future or older than the window."""
        facts = {"seq": self.seq, "block_size": self.block_size, "hash_algo": self.hash_algo}
        oldest = self._changes[0][0] if self._changes else self.seq + 1
        if after is None or after > self.seq or (after < oldest - 1 and after != self.seq):
            return {**facts, "snapshot": True, "block_hashes": sorted(h.hex() for h in self._holders)}
        changes = [(kind, block_hash.hex()) for seq, kind, block_hash in self._changes if seq > after]
        return {**facts, "snapshot": False, "events": changes}


__all__ = ["KVEventLog"]
