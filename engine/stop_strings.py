"""Stop-string matching on incrementally growing text."""

from __future__ import annotations

from typing import NamedTuple


class StopMatch(NamedTuple):
    stop_str: str
    # Length to truncate the text to (the stop string kept or dropped).
    truncate_to: int


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> StopMatch | None:
    """Find the earliest stop string that ends inside the last `new_char_count`
    characters (so text already checked is not searched again, and a match
    spanning old and new text is found)."""
    if not stop or new_char_count <= 0:
        return None
    best: StopMatch | None = None
    best_index = len(output_text)
    for stop_str in stop:
        if not stop_str:
            continue
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and index < best_index:
            best_index = index
            end = index + len(stop_str) if include_in_output else index
            best = StopMatch(stop_str, end)
    return best


def stop_buffer_length(stop: list[str], include_in_output: bool) -> int:
    """Characters to hold back from streamed text so a stop string that is
    only partly generated is never sent (nothing to hide when it is kept)."""
    if not stop or include_in_output:
        return 0
    return max(len(s) for s in stop) - 1
