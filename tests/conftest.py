"""Suite-wide setup. Runs before any test module is imported."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# NOTE: must be set before any @triton.jit function is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two busy threads on two cores make torch 5-70x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)

# Shared test helpers live in tests/helpers (import as `helpers.<module>`).
sys.path.insert(0, str(Path(__file__).parent))


# With pytest-xdist (`make test` runs two workers), a file's tests stay on one
# worker, so its module-scoped servers and engines start once; every test that
# starts Ray shares one worker, so two local Ray clusters never start at once.
_RAY_TEST = re.compile(r"(?<![a-z])ray(?![a-z])")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = "ray" if _RAY_TEST.search(item.nodeid) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
