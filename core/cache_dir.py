"""Where pagedllm keeps what it builds itself (`$PAGEDLLM_CACHE_DIR`).

The shipped models' generated files (model_registry/tiny/cache.py) and the
CPU kernels the platform compiles (platforms/cpu/kernel_build.py) live under
one root; both layers read it from here, the lowest one.
"""

from __future__ import annotations

import os
from pathlib import Path


def get_cache_root() -> Path:
    """`$PAGEDLLM_CACHE_DIR`, else `~/.cache/pagedllm`."""
    env = os.environ.get("PAGEDLLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedllm"
