"""`mp`: one worker process per rank on this host (vLLM's `MultiprocExecutor`).

The executor starts ``tensor_parallel_size`` rank processes
(executors/mp_worker.py), which meet over torch.distributed at
``parallel.master_addr:master_port`` on their platform's backend (gloo on CPU,
NCCL on CUDA) for the model's collectives. The executor itself takes no part
in them: it sends every rank the same msgpack frames over ZMQ (one step's
scheduler output, or a utility call), and reads rank 0's step output.

Supervision: while it waits, the executor watches every rank process; one
that exits (killed, out of memory) or answers with an error makes the
executor fail with a `RankFailedError` naming the rank and the cause, and
every later call fails the same way at once. `shutdown` stops every rank
(asked first, then SIGTERM, then SIGKILL) and a rank whose executor's
process is gone exits by itself (the death pipe in mp_worker.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from pagedllm.distributed.utils import get_distributed_init_method, get_open_port
from pagedllm.executors.base import RankFailedError
from pagedllm.executors.messages import (
    CallWorker,
    InitWorker,
    WorkerReply,
    encode_step,
    encoder,
    raise_reply_error,
    reply_decoder,
)
from pagedllm.executors.remote_ranks import RemoteRanksExecutor

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How often a waiting executor looks at its rank processes.
POLL_MS = 50
# Longest a rank may take to start and join the others (imports, rendezvous).
START_TIMEOUT_S = 300.0
# When a rank answers with an error: how long the others get to show they died.
LOSS_GRACE_S = 1.0
# On shutdown: how long ranks get to exit when asked, then after SIGTERM.
STOP_GRACE_S = 5.0


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL (...)`` or ``exited with status 1``."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        if -returncode == signal.SIGKILL:
            return f"killed by {name} (another process, or the kernel's out-of-memory killer)"
        return f"killed by {name}"
    return f"exited with status {returncode}"


class MultiprocExecutor(RemoteRanksExecutor):
    def _init_executor(self) -> None:
        self._plan_ranks()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._dir = tempfile.mkdtemp(prefix="pagedllm-mp-")
        self._context = zmq.Context()
        self._reply_socket = self._context.socket(zmq.PULL)
        self._reply_socket.bind(f"ipc://{self._dir}/reply")
        self._input_sockets: list[zmq.Socket[bytes]] = []
        # The ranks hold the read end; when this process ends, they read EOF.
        self._death_read, self._death_write = os.pipe()
        try:
            self._start_ranks()
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _start_ranks(self) -> None:
        parallel = self.config.parallel
        init_method = get_distributed_init_method(parallel.master_addr, parallel.master_port or get_open_port())
        config_json = self.config.model_dump_json(exclude={"server"})
        for rank in range(self.world_size):
            socket = self._context.socket(zmq.PUSH)
            address = f"ipc://{self._dir}/rank{rank}"
            socket.bind(address)
            self._input_sockets.append(socket)
            command = [sys.executable, "-m", "pagedllm.executors.mp_worker", "--input", address,
                       "--reply", f"ipc://{self._dir}/reply", "--death-fd", str(self._death_read),
                       "--rank", str(rank)]
            self._procs.append(subprocess.Popen(command, pass_fds=(self._death_read,)))
            socket.send(encoder.encode(InitWorker(config_json, rank, rank, self.world_size, init_method)))
        logger.info("mp executor: %d ranks, pids %s, rendezvous %s",
                    self.world_size, [proc.pid for proc in self._procs], init_method)
        self._wait_replies("init", set(range(self.world_size)), timeout_s=START_TIMEOUT_S)

    # ------------------------------------------------------------- calls

    def _broadcast(self, frame: bytes) -> None:
        self._raise_if_failed()
        for socket in self._input_sockets:
            socket.send(frame)

    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        if kwargs:
            raise TypeError(f"mp executor: {method} takes positional arguments only, got {sorted(kwargs)}")
        self._broadcast(encoder.encode(CallWorker(method, list(args))))
        replies = self._wait_replies(method, set(range(self.world_size)))
        return [replies[rank].value for rank in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(encode_step(scheduler_output))
        replies = self._wait_replies("execute_model", self._step_ranks)
        return self._step_output({rank: reply.output for rank, reply in replies.items()})

    def _wait_replies(self, method: str, ranks: set[int], timeout_s: float | None = None) -> dict[int, WorkerReply]:
        """Replies to `method` from `ranks`, watching every rank meanwhile:
        an error reply from any rank, or a rank that exits, fails the executor."""
        replies: dict[int, WorkerReply] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ranks <= replies.keys():
            if not self._reply_socket.poll(POLL_MS):
                self._check_ranks_alive()
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(ranks - replies.keys())
                    raise self._fail(RankFailedError(missing[0], f"no answer to {method} in {timeout_s:.0f} s"))
                continue
            reply = reply_decoder.decode(self._reply_socket.recv())
            if reply.error is not None:
                raise_reply_error(reply, self._blame)
            if reply.method != method:
                raise self._fail(RankFailedError(reply.rank, f"answered {reply.method} while {method} was due"))
            replies[reply.rank] = reply
        return replies

    def _blame(self, error: RankFailedError) -> RankFailedError:
        """Fail with `error`, unless another rank's process turns out to be
        gone: a collective that breaks on one rank is often the echo of a
        peer that died (its socket reset), and the dead rank is the one to name."""
        deadline = time.monotonic() + LOSS_GRACE_S
        while True:
            try:
                self._check_ranks_alive()
            except RankFailedError as dead:
                return dead
            if time.monotonic() > deadline:
                return self._fail(error)
            time.sleep(POLL_MS / 1000)

    def _check_ranks_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            returncode = proc.poll()
            if returncode is not None:
                raise self._fail(RankFailedError(rank, f"process {proc.pid} {describe_exit(returncode)}"))

    def check_health(self) -> None:
        """Raise (RankFailedError) if a rank has failed or its process is gone."""
        self._raise_if_failed()
        self._check_ranks_alive()

    # ----------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        self._join_step_thread()
        if self._context.closed:
            return
        if self._failure is None and all(proc.poll() is None for proc in self._procs):
            try:
                self._broadcast(encoder.encode(CallWorker("shutdown")))
                self._wait_replies("shutdown", set(range(self.world_size)), timeout_s=STOP_GRACE_S)
            except RankFailedError:
                pass  # stopped below all the same
        self._stop_processes()
        for socket in [*self._input_sockets, self._reply_socket]:
            socket.close(linger=0)
        self._context.term()
        for fd in (self._death_read, self._death_write):
            os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_processes(self) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        # Ranks asked to shut down exit by themselves; after a failure nobody
        # asked them (a survivor may wait in a collective forever): SIGTERM.
        steps: tuple[signal.Signals | None, ...] = (None, signal.SIGTERM, signal.SIGKILL)
        for stop in steps[1:] if self._failure is not None else steps:
            alive = [proc for proc in self._procs if proc.poll() is None]
            if not alive:
                return
            for proc in alive:
                if stop is not None:
                    proc.send_signal(stop)
            for proc in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            deadline = time.monotonic() + STOP_GRACE_S
