"""The front doors without an engine of their own (`pagedllm router`,
`pagedllm disagg-proxy`) exit 0 on SIGTERM, as `pagedllm serve` does, and
not -15 (killed by the signal, which uvicorn re-raises after its shutdown):
a supervisor reads -15 as a crash."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

import httpx
import pytest
from helpers.server import free_port, wait_until

pytestmark = pytest.mark.slow

# NOTE: only guards against a hang; nothing here measures speed.
HANG_GUARD_S = 60.0


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=5.0)
    except httpx.TransportError:
        return False
    return True


@pytest.mark.parametrize("command", [
    ["router", "--backend", "http://127.0.0.1:{unused}"],
    ["disagg-proxy", "--prefill", "http://127.0.0.1:{unused}", "--decode", "http://127.0.0.1:{unused}"],
])
def test_sigterm_stops_a_front_door_with_exit_code_0(command: list[str]) -> None:
    unused, port = free_port(), free_port()  # the backends: nothing listens there
    args = [arg.format(unused=unused) for arg in command]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", *args, "--host",
                                    "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            assert wait_until(lambda: process.poll() is None and _answers(f"http://127.0.0.1:{port}/health"),
                              timeout_s=HANG_GUARD_S)
            process.send_signal(signal.SIGTERM)
            returncode = process.wait(timeout=HANG_GUARD_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        log.seek(0)
        assert returncode == 0, log.read().decode(errors="replace")[-2000:]
