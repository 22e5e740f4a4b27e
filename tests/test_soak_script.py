"""benchmarks/soak.py runs end to end: one short round against a tiny random
model, its table row, and its verdict. (The soak itself is a benchmark, not a test.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_models import cached_tiny_model

SOAK_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_one_short_soak_round_passes_and_reports_idle_server() -> None:
    model_dir = cached_tiny_model("llama", with_tokenizer=True, seed=7)
    completed = subprocess.run(
        [sys.executable, str(SOAK_SCRIPT), "--model", str(model_dir), "--rounds", "1", "--num-requests", "12",
         "--concurrency", "4", "--max-tokens", "8", "--request-timeout-s", "60", "--serve-args",
         "--num-kv-blocks 256"],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1, completed.stdout
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # round, requests, errors, ..., running/waiting after, KV usage after
    assert cells[:3] == ["1", "12", "0"]
    assert cells[7:9] == ["0/0", "0.000"]
    assert float(cells[9]) > 0 and float(cells[11]) > 0  # both RSS values were read
    assert "PASS" in completed.stdout
