"""An append-only list the garbage collector stops scanning as it grows.

A request's accumulated outputs (token ids, each token's logprobs) are long
sequences of objects the collector need not look at: ints, and tuples of
(token id, gc=False `Logprob`) pairs, which it untracks. A list of them is
scanned item by item at every collection of its generation all the same, so
with n=128 x 1,500 tokens of logprobs each full collection in the API
process walked ~600k items (a cache miss each) and held the GIL for up to
150 ms, stalling every client, /health included. Here items go into a small
tail list; every `CHUNK` of them is sealed into a tuple, which the collector
untracks the first time it sees it when its items are untracked, so what it
scans per request stays under `CHUNK` items plus one per chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

CHUNK = 256


class SealedList(Generic[T]):
    """`append`/`extend`, `len` and `since(start)` (a list copy of the items
    from `start` on): what a request's output accumulation needs."""

    __slots__ = ("_chunks", "_tail")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._chunks: list[tuple[T, ...]] = []
        self._tail: list[T] = []
        self.extend(items)

    def append(self, item: T) -> None:
        self._tail.append(item)
        if len(self._tail) >= CHUNK:
            self._seal()

    def extend(self, items: Iterable[T]) -> None:
        self._tail.extend(items)
        if len(self._tail) >= CHUNK:
            self._seal()

    def _seal(self) -> None:
        tail = self._tail
        whole = len(tail) - len(tail) % CHUNK
        self._chunks.extend(tuple(tail[start:start + CHUNK]) for start in range(0, whole, CHUNK))
        del tail[:whole]

    def __len__(self) -> int:
        return len(self._chunks) * CHUNK + len(self._tail)

    def since(self, start: int = 0) -> list[T]:
        """The items from `start` on, as a new list."""
        first = start // CHUNK  # never past len(self._chunks): the tail is shorter than CHUNK
        out: list[T] = []
        for chunk in self._chunks[first:]:
            out.extend(chunk)
        out.extend(self._tail)
        del out[:start - first * CHUNK]
        return out

    def __repr__(self) -> str:
        return f"SealedList({self.since()!r})"


__all__ = ["CHUNK", "SealedList"]
