"""benchmarks/soak.py runs end to end: one short round against a tiny random
model, its table row, and its verdict. (The soak itself is a benchmark, not a test.)
Its leak rule looks at the engine's RSS less the KV cache's resident pages."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.tiny_models import cached_tiny_model

SOAK_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak_script", SOAK_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_engine_growth_that_is_resident_kv_is_not_a_leak() -> None:
    soak = load_soak()
    args = argparse.Namespace(max_rss_growth_mb=8.0, idle_timeout_s=30.0)
    result = soak.RoundResult([soak.Outcome(latency_s=0.1)], wall_s=1.0)
    before = soak.RoundState(True, {}, (100.0, 500.0), kv_resident=40.0)
    # The engine grew 30 MB, 27 of them KV pages written for the first time: 3 MB of the rest.
    kv_growth = soak.RoundState(True, {}, (102.0, 530.0), kv_resident=67.0)
    row, failures = soak.summarize_round(2, result, kv_growth, before, args)
    assert failures == []
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[9:15] == ["102.0", "+2.0", "530.0", "67.0", "463.0", "+3.0"]
    # The same RSS growth with KV resident grown by only 10 MB: 20 MB of the rest.
    leak = soak.RoundState(True, {}, (102.0, 530.0), kv_resident=50.0)
    _, failures = soak.summarize_round(2, result, leak, before, args)
    assert failures == ["round 2: engine RSS less resident KV grew 20.0 MB (> 8.0 MB)"]
    # Resident KV unknown: the whole RSS is checked.
    unknown = soak.RoundState(True, {}, (102.0, 530.0), kv_resident=None)
    _, failures = soak.summarize_round(2, result, unknown, before, args)
    assert failures == ["round 2: engine RSS grew 30.0 MB (> 8.0 MB)"]


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
    # The KV cache's written pages, measured in the engine, and the RSS without them.
    engine_rss, kv_resident, engine_rest = (float(cell) for cell in cells[11:14])
    assert 0 < kv_resident < engine_rss
    assert abs(engine_rss - kv_resident - engine_rest) < 0.11
    assert "PASS" in completed.stdout
