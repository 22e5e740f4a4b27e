"""benchmarks/gpu_check.sh --cpu-dry-run: the GPU check's plumbing works on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_passes() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=480,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert "=== triton kernels (interpreter, subset): ok" in out
    assert "=== backend selection: ok" in out
    assert "torch_native ms" in out and "triton ms" in out  # the kernel table
    assert "decode batch=2 seq=40" in out and "prefill batch=1 seq=24" in out
    assert "all backends within" in out
    assert "=== latent attention kernels (interpreter, subset): ok" in out
    assert "=== fused-MoE kernel (interpreter, subset): ok" in out
    assert "triton ms" in out and "tiny              9" in out  # the MoE kernel table
    assert out.rstrip().endswith("gpu_check --cpu-dry-run: all stages passed")


def test_gpu_check_rejects_unknown_arguments() -> None:
    result = subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh"), "--bogus"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage:" in result.stderr
