"""Large host buffers on fresh anonymous mappings, with transparent huge pages asked for.

A fresh anonymous mapping is zero by the kernel's guarantee and none of its
pages is written until used, so a large buffer (the KV cache) costs nothing
up front.

The AMX kernel's packed weights are streamed through whole in every decode
step (151 MB on the ~100M model). On 4 KB pages that is a TLB miss every
4 KB and a hardware prefetcher that stops at each page's end. Linux backs a
mapping with 2 MB pages where the mapping asks for them (MADV_HUGEPAGE; the
usual `madvise` setting of /sys/kernel/mm/transparent_hugepage/enabled
gives them to no one else): those GEMMs took 0.93x the time (one thread,
caches cold). The KV cache does not ask: its blocks are first touched
during steps, and a 2 MB fault there (zeroing, perhaps compaction) cost a
prefill step more than the TLB saved. Where madvise or huge pages are not
available the buffer is the same, on small pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

PAGE_SIZE = mmap.PAGESIZE
# mincore's flag per page: bit 0 says resident, the others are reserved.
_RESIDENT_BIT = bytes(value & 1 for value in range(256))


def anonymous_zeros(numel: int, dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` zeros on its own private anonymous mapping;
    `huge_pages`: advised to use transparent huge pages (for a buffer written
    whole at once: each first touch of a huge page zeroes 2 MB, and may wait
    for the kernel to compact memory)."""
    if numel == 0:
        return torch.zeros(0, dtype=dtype)
    # NOTE: private and anonymous: zero by the kernel's guarantee, never shared with a child.
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if huge_pages and advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without THP
            buffer.madvise(advice)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)


def resident_bytes(address: int, num_bytes: int) -> int | None:
    """Bytes of the pages of [address, address + num_bytes) that are in RAM
    (Linux `mincore`); None where it cannot tell. A fresh anonymous mapping
    (the CPU KV cache) counts only the pages written so far: what a growing
    RSS is made of while the cache fills."""
    if num_bytes <= 0:
        return 0
    start = address - address % PAGE_SIZE
    num_pages = -(-(address + num_bytes - start) // PAGE_SIZE)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vector = (ctypes.c_ubyte * num_pages)()
    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(num_pages * PAGE_SIZE), vector) != 0:
        return None
    return bytes(vector).translate(_RESIDENT_BIT).count(1) * PAGE_SIZE
