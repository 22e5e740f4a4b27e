"""Build-once cache folders for artifacts pagedllm generates itself."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pagedllm.core.cache_dir import get_cache_root


def build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Return `<cache root>/<name>`, calling `build(tmp_dir)` first if it is missing.

    The folder is built in a temporary sibling and renamed into place, so a
    folder that exists is always complete. When two processes build at the same
    time the first rename wins and the loser discards its copy.
    """
    root = get_cache_root()
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # NOTE: rename onto an existing non-empty folder fails: a
            # concurrent builder won the race, and its folder is complete.
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
