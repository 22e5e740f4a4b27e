"""Where the processes of one engine meet (vLLM's helpers of the same names)."""

from __future__ import annotations

import socket

# NOTE: loopback only: the ranks of one engine run on this machine, and a
# rendezvous port bound on every interface would let anyone join the group.
LOOPBACK_IP = "127.0.0.1"


def get_distributed_init_method(ip: str, port: int) -> str:
    """``tcp://127.0.0.1:29500``: the rendezvous `init_process_group` takes."""
    # An IPv6 address needs brackets, or its colons read as the port separator.
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"


def get_open_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK_IP, 0))
        return int(sock.getsockname()[1])
