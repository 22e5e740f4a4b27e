"""Suite-wide setup. Runs before any test module is imported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# NOTE: must be set before any @triton.jit function is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two busy threads on two cores make torch 5-70x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

torch.set_num_threads(1)

# Shared test helpers live in tests/helpers (import as `helpers.<module>`).
sys.path.insert(0, str(Path(__file__).parent))

