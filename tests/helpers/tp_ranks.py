"""Run a test script as a group of gloo ranks on 127.0.0.1 and collect what each saved.

The parent starts ``python SCRIPT RANK WORLD_SIZE INIT_METHOD OUT_DIR
*ARGS`` once per rank (plain subprocesses: one torch thread each, nothing
inherited), waits with a deadline and kills whatever is left, so a hung
collective fails the test instead of hanging it and leaves no process behind.
Each rank saves a dict of tensors/numbers to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from pagedllm.distributed.utils import LOOPBACK_IP, get_distributed_init_method, get_open_port


def run_ranks(script: str | Path, world_size: int, out_dir: Path, *args: str, timeout: float = 60.0) -> list[Any]:
    init_method = get_distributed_init_method(LOOPBACK_IP, get_open_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tests_dir = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), init_method, str(out_dir), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world_size)
    ]
    outputs: list[str] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [
        (rank, proc.returncode, out)
        for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True))
        if proc.returncode
    ]
    if failed or len(outputs) < world_size:
        raise AssertionError(f"ranks failed: {failed or outputs}")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


def init_rank_from_argv() -> tuple[int, int, Path, list[str]]:
    """In a rank script: join the group named on the command line; (rank, world_size, out_dir, extra args)."""
    from pagedllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    torch.set_num_threads(1)
    rank, world_size, init_method, out_dir, *args = sys.argv[1:]
    init_distributed_environment(int(world_size), int(rank), init_method, "gloo")
    initialize_model_parallel(int(world_size))
    return int(rank), int(world_size), Path(out_dir), args
