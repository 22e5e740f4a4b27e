"""The CPU C kernels built for an older -march than this CPU's, so that the
code paths a newer CPU never takes are tested here too."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from pagedllm.platforms.cpu import kernel_build as cpu_kernel_build

# Kernel tests skip only where a kernel cannot be built at all; with a
# compiler present, a kernel that fails to build fails its tests.
NO_COMPILER = pytest.mark.skipif(cpu_kernel_build.find_compiler() is None, reason="no C compiler (cc, gcc or $CC)")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return set(next((line for line in cpuinfo if line.startswith("flags")), "").split())
    except OSError:
        return set()


def build_for_march(source: Path, cflags: tuple[str, ...], march: str, directory: Path) -> ctypes.CDLL:
    """`source` built with `cflags`, -march=native replaced by `march`; the
    test is skipped when the compiler cannot build for it."""
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in cflags)
    target = directory / f"{source.stem}-{march}.so"
    try:
        cpu_kernel_build.build(source, flags, target)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"the C compiler cannot build for -march={march}: {exc}")
    return ctypes.CDLL(str(target))
