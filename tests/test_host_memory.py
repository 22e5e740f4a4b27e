"""platforms/host_memory.py: big host buffers are zero, untouched until
used, and ask Linux for transparent huge pages where told to."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from pagedllm.platforms.host_memory import anonymous_zeros


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
