"""Build-on-first-use for the CPU kernels written in plain C (loaded with ctypes).

A kernel library is one C file with no Python or torch headers: the system C
compiler builds it in about a second, once per source version, flags and CPU
model (-march=native code runs only on the CPU it was built for), into
`$PAGEDLLM_CACHE_DIR/kernels/`. No compiler, a failed build or the kernel's
environment switch set to 0 means no library: the caller keeps its torch
path, and the reason is logged once per library.

Libraries built with -fopenmp link `libgomp.so.1`, which torch (imported
first) has already loaded: their parallel loops run on torch's own thread
team, at torch.get_num_threads() threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pagedllm.core.cache_dir import get_cache_root

logger = logging.getLogger(__name__)
# One build at a time per library: a second caller (a background prebuild
# and the first use racing) waits and then loads what the first one built.
_build_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


@functools.cache
def cpu_fingerprint() -> str:
    """The CPU model's identity for -march=native code: architecture and flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


# The kernels' shared headers (cpu_kernel_math.h, cpu_amx.h): on every
# build's include path, and part of every build's key.
INCLUDE_DIR = Path(__file__).parent / "csrc"


def library_path(source: Path, cflags: tuple[str, ...]) -> Path:
    headers = b"".join(header.read_bytes() for header in sorted(INCLUDE_DIR.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(cflags).encode() + cpu_fingerprint().encode())
    return get_cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def find_compiler() -> str | None:
    """The C compiler builds use: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path, cflags: tuple[str, ...], target: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *cflags, f"-I{INCLUDE_DIR}", "-o", tmp, str(source)], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder's file is as good
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, cflags: tuple[str, ...], env_switch: str, what: str) -> ctypes.CDLL | None:
    """The library built from `source` (built now if needed), or None when
    `env_switch` is "0" or it cannot be built (logged at INFO, naming `what`)."""
    if os.environ.get(env_switch, "1") == "0":
        return None
    try:
        path = library_path(source, cflags)
        with _locks_guard:
            lock = _build_locks.setdefault(path, threading.Lock())
        with lock:
            if not path.exists():
                build(source, cflags, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.info("%s unavailable (%s %s); the torch path runs instead",
                    what, exc, detail.decode(errors="replace")[:500])
        return None


_prebuilt: set[Callable[[], object]] = set()


def prebuild_in_background(load: Callable[[], object]) -> None:
    """Call `load` (a kernel's cached loader) on a daemon thread, once per
    process, so that a first build's compile (about a second of CPU, once per
    machine) overlaps the model's loading instead of delaying the first
    request. The compiler runs in a subprocess, so the thread holds no GIL
    while it waits."""
    with _locks_guard:
        if load in _prebuilt:
            return
        _prebuilt.add(load)
    threading.Thread(target=load, name="kernel-prebuild", daemon=True).start()
