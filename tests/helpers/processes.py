"""Find the `mp` executor's rank processes by reading /proc (no psutil).

A rank process runs ``python -m pagedllm.executors.mp_worker ... --rank N``;
it is a child of the process that built the engine (the test process for an
in-process `LLM`, the engine-core process under `pagedllm serve`), so it is
found among the live descendants of that process.
"""

from __future__ import annotations

import time
from pathlib import Path

from helpers.server import descendant_pids, is_alive, wait_until

RANK_MODULE = "pagedllm.executors.mp_worker"


def cmdline(pid: int) -> list[str]:
    """The argv of `pid` ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def rank_processes(ancestor: int) -> dict[int, int]:
    """pid -> rank of every live `mp` rank process below `ancestor` (at any depth)."""
    ranks = {}
    for pid in descendant_pids(ancestor):
        argv = cmdline(pid)
        if RANK_MODULE in argv and "--rank" in argv[:-1]:
            ranks[pid] = int(argv[argv.index("--rank") + 1])
    return ranks


def pid_of_rank(ranks: dict[int, int], rank: int) -> int:
    (pid,) = [pid for pid, found in ranks.items() if found == rank]
    return pid


def wait_gone(pids: list[int] | set[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` is alive; those still alive after `timeout_s`."""
    wait_until(lambda: not any(is_alive(pid) for pid in pids), timeout_s=timeout_s)
    return [pid for pid in pids if is_alive(pid)]


def cpu_ticks(pid: int) -> int:
    """User + system CPU time `pid` has used, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    return int(fields[11]) + int(fields[12])


def wait_busy_then_quiet(pid: int, baseline_ticks: int, quiet_s: float, timeout_s: float) -> bool:
    """Wait until `pid` has used CPU since `baseline_ticks` and then used none
    for `quiet_s` (started some work, now blocked in it); False on timeout."""
    deadline = time.monotonic() + timeout_s
    if not wait_until(lambda: cpu_ticks(pid) > baseline_ticks, timeout_s=timeout_s):
        return False
    last_ticks, changed_at = cpu_ticks(pid), time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() - changed_at >= quiet_s:
            return True
        time.sleep(0.02)
        ticks = cpu_ticks(pid)
        if ticks != last_ticks:
            last_ticks, changed_at = ticks, time.monotonic()
    return False
