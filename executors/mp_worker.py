"""A rank process of the `mp` executor: ``python -m pagedllm.executors.mp_worker``.

It connects to the executor's two sockets (its own input, the shared reply
socket), then answers frames until told to shut down. It never outlives the
process that started it: the executor holds the write end of a pipe whose
read end (``--death-fd``) this process watches; when the executor's process
ends for any reason (SIGKILL too), the pipe reads EOF and the rank exits,
even in the middle of a collective.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

import zmq

from pagedllm.executors.worker_host import WorkerHost

logger = logging.getLogger(__name__)

# Exit status of a rank whose executor went away (the death pipe closed).
ORPHANED_EXIT_CODE = 3


def watch_parent(death_fd: int) -> None:
    """Exit this process as soon as `death_fd` reads EOF (its writer is gone)."""

    def wait() -> None:
        try:
            while os.read(death_fd, 1):
                pass
        except OSError:
            pass
        os._exit(ORPHANED_EXIT_CODE)

    threading.Thread(target=wait, name="pagedllm-death-pipe", daemon=True).start()


def serve(input_address: str, reply_address: str) -> None:
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    reply_socket = context.socket(zmq.PUSH)
    input_socket.connect(input_address)
    reply_socket.connect(reply_address)
    host = WorkerHost()
    try:
        while not host.stopped:
            frame = input_socket.recv(copy=False)
            reply = host.handle(frame.buffer)
            if reply is not None:
                reply_socket.send(reply)
    finally:
        input_socket.close(linger=0)
        # The last reply (shutdown's) must leave before the process does.
        reply_socket.close(linger=2000)
        context.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--input", required=True, help="the executor's socket for this rank's frames")
    parser.add_argument("--reply", required=True, help="the executor's reply socket")
    parser.add_argument("--death-fd", type=int, required=True, help="pipe that reads EOF when the executor is gone")
    parser.add_argument("--rank", type=int, required=True, help="for log lines until InitWorker arrives")
    args = parser.parse_args(argv)
    watch_parent(args.death_fd)
    # Ctrl-C in a terminal reaches the whole process group: the executor
    # decides when ranks stop, not the keyboard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s (rank {args.rank} pid {os.getpid()}) %(name)s: %(message)s",
    )
    serve(args.input, args.reply)


if __name__ == "__main__":
    main()
