"""SealedList: an append-only list whose full chunks the collector stops scanning."""

from __future__ import annotations

import gc

import pytest

from pagedllm.engine.sealed_list import CHUNK, SealedList


@pytest.mark.parametrize("length", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
def test_since_is_the_plain_lists_slice_at_every_start(length):
    reference = list(range(length))
    appended: SealedList[int] = SealedList()
    for item in reference:
        appended.append(item)
    extended = SealedList(reference[:5])
    extended.extend(reference[5:])
    for sealed in (appended, extended):
        assert len(sealed) == length
        assert [sealed.since(start) for start in range(length + 1)] == [
            reference[start:] for start in range(length + 1)
        ]


def test_sealed_chunks_of_untracked_items_leave_the_collectors_lists():
    sealed = SealedList((index, -0.5) for index in range(2 * CHUNK + 3))
    for _ in range(2):  # the pairs, then the chunks of them
        gc.collect()
    assert [gc.is_tracked(chunk) for chunk in sealed._chunks] == [False, False]
    assert len(sealed._tail) == 3
