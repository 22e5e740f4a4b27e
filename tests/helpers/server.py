"""Start the real `pagedllm serve` as a subprocess on a free 127.0.0.1 port.

    with start_server(model_dir, "--num-kv-blocks", "64") as server:
        httpx.get(f"{server.base_url}/health")

On exit the server gets SIGTERM (then SIGKILL), and every process it started
(the engine core, multiprocessing's resource tracker) is killed by pid if it
outlived it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 90.0


@dataclass
class ServerProcess:
    base_url: str
    pid: int
    process: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list[int]:
        return descendant_pids(self.pid)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parent_pids() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces; fields after ")" are fixed.
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
    return parents


def descendant_pids(pid: int) -> list[int]:
    """Live (not zombie) descendants of `pid`, children first."""
    parents = _parent_pids()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and is_alive(child)]
        found.extend(children)
        frontier.extend(children)
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


@contextmanager
def start_server(
    model: str | Path | None, *args: str, api_key: str | None = None, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """`model=None` runs `pagedllm serve` with no MODEL, as `make serve` does."""
    model_args = [] if model is None else [str(model)]
    command = ["serve", *model_args, "--log-stats-interval-s", "0", *args]
    if api_key is not None:
        command += ["--api-key", api_key]
    with start_cli_server(command, api_key=api_key, env=env) as server:
        yield server


@contextmanager
def start_cli_server(
    cli_args: list[str], api_key: str | None = None, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """`pagedllm <cli_args> --host 127.0.0.1 --port <free>`, healthy, then stopped by pid."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", *cli_args, "--host", "127.0.0.1", "--port", str(port)]
    process_env = {**os.environ, **(env or {})}
    with tempfile.NamedTemporaryFile(prefix="pagedllm-serve-", suffix=".log", delete=False) as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=process_env)
        server = ServerProcess(f"http://127.0.0.1:{port}", process.pid, process, Path(log_file.name), api_key)
        try:
            _wait_for_health(server)
            yield server
        finally:
            stop_server(server)
            os.unlink(log_file.name)


def _wait_for_health(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: ServerProcess, timeout_s: float = 15.0) -> None:
    """SIGTERM the server, SIGKILL it if it hangs, reap it, then kill (by pid)
    any process it started that outlived it."""
    descendants = server.descendants()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    for pid in descendants:
        if is_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
