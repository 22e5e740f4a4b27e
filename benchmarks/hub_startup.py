"""Start-up from a warm hub cache against the same model from a local folder.

A fake hub on 127.0.0.1 (tests/helpers/fake_hub.py) serves `--model`'s
files (default: the ~100M benchmark Llama) as `org/bench`; one download
warms the cache under a scratch HF_HOME. Then `LLM(model=...)` is built in a
fresh subprocess, interleaved `--reps` times each, from: the local folder;
the hub id online (the revision is resolved against the hub, nothing is
downloaded); the hub id with HF_HUB_OFFLINE=1 (no request at all). Times are
the constructor's wall time, best and median.

    .venv/bin/python benchmarks/hub_startup.py [--reps 5] [--model FOLDER]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
REPO_ID = "org/bench"


def build_once(model: str) -> None:
    import time

    import torch

    from pagedllm import LLM

    torch.set_num_threads(2)
    start = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", num_kv_blocks=64)
    print(json.dumps({"seconds": time.perf_counter() - start}))
    llm.shutdown()


def timed(model: str, env: dict[str, str]) -> float:
    done = subprocess.run([sys.executable, __file__, "--child", model], env=env, check=True, capture_output=True,
                          text=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default=None, metavar="FOLDER", help="default: the ~100M benchmark Llama")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        build_once(args.child)
        return
    from helpers.fake_hub import FakeHub

    from pagedllm.model_registry.tiny import get_benchmark_100m_model_dir

    folder = Path(args.model or get_benchmark_100m_model_dir())
    hub = FakeHub().start()
    hub.commit(REPO_ID, {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()})
    with tempfile.TemporaryDirectory(prefix="pagedllm-hub-bench-") as home:
        online = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": home, "HF_HUB_OFFLINE": "0"}
        online.pop("HF_TOKEN", None)
        timed(REPO_ID, online)  # the download: warms the cache
        rows: dict[str, tuple[str, dict[str, str]]] = {
            "local folder": (str(folder), online),
            "hub id, warm cache": (REPO_ID, online),
            "hub id, HF_HUB_OFFLINE=1": (REPO_ID, {**online, "HF_HUB_OFFLINE": "1"}),
        }
        times: dict[str, list[float]] = {label: [] for label in rows}
        for _ in range(args.reps):
            for label, (model, env) in rows.items():
                times[label].append(timed(model, env))
    hub.stop()
    print(f"\nLLM(model=...) wall time, {folder.name}, {args.reps} interleaved runs each")
    print(f"{'source':<28}{'best s':>8}{'median s':>10}")
    for label, values in times.items():
        print(f"{label:<28}{min(values):>8.2f}{statistics.median(values):>10.2f}")


if __name__ == "__main__":
    main()
