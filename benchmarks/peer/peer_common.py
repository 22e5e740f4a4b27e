"""What the peer scripts share: the placement both engines get (same cores,
same KV cache bytes), child processes that answer one JSON line, and the
markdown ratio table.

Standard library only: offline.py imports this module in vLLM's scratch
virtualenv too, where pagedllm is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_VLLM_PYTHON = "/work/peer-venv/bin/python"
PEER_DIR = Path(__file__).resolve().parent
REPO_ROOT = PEER_DIR.parents[1]
# The peers by name: pagedllm, and vLLM in two placements on the same cores.
# "vllm-2c" binds vLLM's worker to every core given, one OpenMP thread per
# core; "vllm" is vLLM's own default (VLLM_CPU_OMP_THREADS_BIND=auto), which
# on a 2-core host keeps one core back for its scheduler process, so the
# forward pass gets one.
PEERS = ("pagedllm", "vllm-2c", "vllm")
ENGINES = ("pagedllm", "vllm-2c")  # offline.py, lora.py: pagedllm against vLLM on the same cores
RESULT_PREFIX = "PEER-RESULT "


def engine_of(peer: str) -> str:
    """The engine behind a peer name: 'vllm' for either vLLM placement."""
    if peer not in PEERS:
        raise ValueError(f"{peer!r}: expected one of {', '.join(PEERS)}")
    return "vllm" if peer.startswith("vllm") else "pagedllm"


def parse_peers(spec: str) -> list[str]:
    """'pagedllm,vllm-2c' -> ['pagedllm', 'vllm-2c'], each name checked."""
    peers = [name.strip() for name in spec.split(",") if name.strip()]
    for name in peers:
        engine_of(name)
    if not peers or len(set(peers)) != len(peers):
        raise ValueError(f"{spec!r}: expected distinct names from {', '.join(PEERS)}")
    return peers


@dataclass(frozen=True)
class Placement:
    """Where and with how much memory both engines run: the same cores (the
    whole process tree pinned there; vLLM's OpenMP threads bound to them
    too) and the same KV cache size."""

    cores: tuple[int, ...]
    kv_cache_gib: int
    vllm_python: str
    vllm_env: tuple[tuple[str, str], ...] = ()  # extra KEY=VALUE for vLLM's processes
    pagedllm_env: tuple[tuple[str, str], ...] = ()  # and for pagedllm's

    def env(self, peer: str) -> dict[str, str]:
        """The environment of `peer`'s processes (a PEERS name; anything
        else, e.g. the bench client, gets this process's own)."""
        env = dict(os.environ)
        if peer in ("vllm-2c", "vllm"):
            # VLLM_CPU_OMP_THREADS_BIND: vllm-2c's worker runs one OpenMP
            # thread per listed core, bound to it; "auto" is vLLM's default.
            # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (vLLM's default is 4).
            env["VLLM_CPU_OMP_THREADS_BIND"] = format_cores(self.cores) if peer == "vllm-2c" else "auto"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
            env.update(dict(self.vllm_env))
        elif peer == "pagedllm":
            env.update(dict(self.pagedllm_env))
        return env

    def python(self, peer: str) -> str:
        return self.vllm_python if peer in ("vllm-2c", "vllm") else sys.executable

    def pin(self) -> None:
        """preexec_fn: the child (and everything it starts) runs on `cores`."""
        os.sched_setaffinity(0, self.cores)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_gib << 30


def parse_cores(spec: str) -> tuple[int, ...]:
    """'0-1' or '0,2-3' -> (0, 1) / (0, 2, 3), in vLLM's VLLM_CPU_OMP_THREADS_BIND syntax."""
    cores: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        last = last if dash else first
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ValueError(f"--cores={spec!r}: expected core ids like '0-1' or '0,2-3'")
        cores.extend(range(int(first), int(last) + 1))
    if not cores or len(set(cores)) != len(cores):
        raise ValueError(f"--cores={spec!r}: expected distinct core ids")
    return tuple(cores)


def format_cores(cores: Sequence[int]) -> str:
    return ",".join(str(core) for core in cores)


def parse_env_pairs(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    parsed = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r}: expected KEY=VALUE")
        parsed.append((key, value))
    return tuple(parsed)


def peers_arg(spec: str) -> list[str]:
    """argparse type of --engines: parse_peers, its error as argparse's."""
    try:
        return parse_peers(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--python-vllm", default=DEFAULT_VLLM_PYTHON, help="python of the scratch venv with vllm-cpu (%(default)s)")
    add("--cores", default="0-1", help="cores both engines run on, pinned (default %(default)s)")
    add("--kv-cache-gib", type=int, default=1, help="KV cache of both engines, GiB (default %(default)s)")
    add("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for vLLM only, e.g. VLLM_ENABLE_V1_MULTIPROCESSING=0 or LD_PRELOAD=...")
    add("--pagedllm-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for pagedllm only, e.g. OMP_PROC_BIND=true")


def placement_from_args(args: argparse.Namespace) -> Placement:
    return Placement(cores=parse_cores(args.cores), kv_cache_gib=args.kv_cache_gib, vllm_python=args.python_vllm,
                     vllm_env=parse_env_pairs(args.vllm_env), pagedllm_env=parse_env_pairs(args.pagedllm_env))


def engine_order(rep: int, peers: Sequence[str] = ENGINES) -> tuple[str, ...]:
    """`peers` rotated by `rep`: rep 0 runs the first one first, rep 1 the
    second, and so on (two peers alternate), so that no peer always gets the
    warmer (or the quieter) part of the machine's time."""
    shift = rep % len(peers) if peers else 0
    return tuple(peers[shift:]) + tuple(peers[:shift])


def run_json_child(cmd: list[str], env: dict[str, str], placement: Placement, timeout: float, label: str) -> dict:
    """Run `cmd` pinned to the placement's cores, in its own process group
    (stopped whole if anything goes wrong here: vLLM forks an engine core and
    a worker); its answer is the last stdout line print_result wrote."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=placement.pin, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    finally:
        stop_process_group(child, grace_s=10.0)
    if child.returncode != 0:
        raise RuntimeError(f"{label} failed (rc={child.returncode}): {' '.join(cmd)}\n{stderr[-4000:]}")
    answers = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not answers:
        raise RuntimeError(f"{label} printed no {RESULT_PREFIX!r} line:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return json.loads(answers[-1][len(RESULT_PREFIX):])


def print_result(answer: dict) -> None:
    """The child's answer: one line, marked (engines print to stdout too)."""
    print(RESULT_PREFIX + json.dumps(answer), flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a process started with start_new_session=True and everything it
    forked (its process group, by its id): SIGTERM, then SIGKILL to whatever
    is left after `grace_s` (the leader) or 5 more seconds (its workers)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    deadline = time.monotonic() + 5.0
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def speedup(pagedllm: float, vllm: float, higher_is_better: bool) -> float:
    """pagedllm's advantage, > 1 when pagedllm is better: pagedllm/vLLM for a
    rate, vLLM/pagedllm for a time."""
    if not (pagedllm > 0 and vllm > 0):
        return float("nan")
    return pagedllm / vllm if higher_is_better else vllm / pagedllm


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's
    default), NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"  # NaN != NaN


def fmt_ratio(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}x"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
