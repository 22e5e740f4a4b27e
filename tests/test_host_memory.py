"""platforms/cpu/host_memory.py: big host buffers are zero, untouched until
used, and ask Linux for transparent huge pages where told to."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from pagedllm.platforms.cpu.host_memory import PAGE_SIZE, anonymous_zeros, resident_bytes


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    flags: set[str] = set()
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(part, 16) for part in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                flags = set(line.split()[1:])
    return flags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_buffers_are_zero_and_writable(dtype: torch.dtype) -> None:
    buffer = anonymous_zeros(3 << 20, dtype)
    assert buffer.shape == (3 << 20,) and buffer.dtype == dtype
    assert not bool(buffer.any())
    buffer[12345] = 7
    assert int(buffer.nonzero().item()) == 12345
    assert anonymous_zeros(0, dtype).numel() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux madvise")
def test_huge_pages_are_asked_for_only_on_request() -> None:
    assert "hg" in _vm_flags(anonymous_zeros(8 << 20, torch.bfloat16, huge_pages=True).data_ptr())  # MADV_HUGEPAGE
    assert "hg" not in _vm_flags(anonymous_zeros(8 << 20, torch.bfloat16).data_ptr())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore's anonymous-page answer is Linux's")
def test_resident_bytes_counts_the_pages_written_so_far() -> None:
    num_pages = 64
    buffer = mmap.mmap(-1, num_pages * PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # one write must fault in one small page, not 2 MB
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert resident_bytes(address, num_pages * PAGE_SIZE) == 0
    buffer[0] = 1
    buffer[10 * PAGE_SIZE + 5] = 1
    buffer[11 * PAGE_SIZE - 1] = 1  # the last byte of page 10: no new page
    assert resident_bytes(address, num_pages * PAGE_SIZE) == 2 * PAGE_SIZE
    # A range inside one page counts that whole page; one past the written pages, none.
    assert resident_bytes(address + 10 * PAGE_SIZE + 100, 8) == PAGE_SIZE
    assert resident_bytes(address + 20 * PAGE_SIZE, 40 * PAGE_SIZE) == 0
    assert resident_bytes(address, 0) == 0
