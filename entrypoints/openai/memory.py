"""Handing freed heap memory back to the OS after an oversized request.

glibc keeps what a large request freed (the tokenizer's encoding of a 4 MB
prompt, the parsed body) in its arenas, so the API process stayed ~300 MB
larger after one such request. `malloc_trim(0)` returns the free pages of
every arena; elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _malloc_trim() -> Any | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_process_memory() -> bool:
    """Return free heap pages to the OS; True if glibc released any.

    NOTE: a ctypes call releases the GIL, so it does not stall other threads."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False

