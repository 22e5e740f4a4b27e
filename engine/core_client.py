"""Clients of EngineCore. The front end (LLM, the HTTP server) talks to the
core only through this interface, so the core can run in-process (here) or in
its own process behind ZMQ (the server issue) without the front end changing."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from pagedllm.core.errors import EngineDeadError, EngineStartupError
from pagedllm.engine.core_proc import ready_message, run_engine_core
from pagedllm.engine.wire import (
    AbortRequests,
    AddRequests,
    CoreInput,
    CoreInputEncoder,
    CoreOutput,
    CoreOutputDecoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    Ready,
    Shutdown,
    StartupFailed,
    UtilityRequest,
    UtilityResult,
    from_engine_core_request,
)

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.engine import EngineCore, StepResult
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.core.stats import SchedulerStats


class EngineCoreClient(ABC):
    """A blocking front end's view of one engine core, wherever it runs."""

    # The core's figures (max_model_len, vocab size, EOS, model path, ...):
    # all a front end may know about the core besides its outputs.
    ready: Ready

    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> list[EngineCoreOutput]:
        """Outputs of the next engine step (empty when the core is idle)."""

    def next_outputs(self) -> EngineCoreOutputs:
        """The next step's whole message: its outputs with the stats made
        after it (what LLM's stat loggers record). This default has no stats."""
        return EngineCoreOutputs(self.get_output(), None, 0, time.time())

    @abstractmethod
    def get_stats(self) -> SchedulerStats | None:
        """The core's SchedulerStats now (its prefix-cache counts cover the
        time since the previous stats); None if the core sent none."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    def drain(self) -> None:  # noqa: B027 - a hook: only the in-process client has work
        """Let the core finish what it still holds once every output is in
        (a KV connector's save in flight); a core in its own process steps
        on its own, so only the in-process client has work here."""

    def shutdown(self) -> None:  # noqa: B027 - a hook: nothing to release in-process
        """Release the core (no-op in-process)."""


class InprocClient(EngineCoreClient):
    """Runs EngineCore in the caller's thread: one step per get_output()."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.engine.builder import build_engine

        parts = build_engine(config)
        self.engine_core: EngineCore = parts.engine_core
        self.executor = parts.executor
        self.ready = ready_message(parts)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.engine_core.add_request(from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        if not self.engine_core.has_unfinished_requests():
            return []
        return self._step().outputs

    def next_outputs(self) -> EngineCoreOutputs:
        if not self.engine_core.has_unfinished_requests():
            return EngineCoreOutputs([], None, 0, time.time())
        result = self._step()
        stats = self.engine_core.make_stats()
        return EngineCoreOutputs(result.outputs, stats, result.num_scheduled_tokens, time.time())

    def _step(self) -> StepResult:
        result = self.engine_core.step()
        if not result.made_progress:
            self.engine_core.wait_for_work()  # only grammars compiling: no spinning
        return result

    def get_stats(self) -> SchedulerStats | None:
        return self.engine_core.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def drain(self) -> None:
        """Step until the core has nothing left, e.g. finished requests
        whose blocks a KV connector still reads (a save in flight)."""
        while self.engine_core.has_unfinished_requests():
            self._step()

    def shutdown(self) -> None:
        """Stop the executor's workers (the in-process `uni` releases its rank)."""
        self.engine_core.shutdown()
        self.executor.shutdown()


# ------------------------------------------------------------ multi-process

# How long a reader waits for the core before it checks the core is alive.
LIVENESS_POLL_S = 0.5
# A Shutdown message, then SIGTERM, then SIGKILL, each given this long.
SHUTDOWN_GRACE_S = 5.0
DEFAULT_STARTUP_TIMEOUT_S = 600.0
# How long a reader waits, once a core's process closed its sentinel, for its exit status.
EXIT_STATUS_WAIT_S = 1.0


class _CoreResources:
    """What MPClient must release: the core (process or thread), the sockets,
    the socket folder. A plain object so weakref.finalize can hold it (it
    runs at interpreter exit too: no orphan engine core)."""

    def __init__(self) -> None:
        self.context: Any = None
        self.input_socket: Any = None
        self.output_socket: Any = None
        self.process: Any = None
        self.thread: threading.Thread | None = None
        self.socket_dir: str | None = None

    def shutdown(self) -> None:
        if self.input_socket is not None:
            with contextlib.suppress(zmq.ZMQError):  # no core to tell
                self.input_socket.send(CoreInputEncoder().encode(Shutdown()), flags=zmq.NOBLOCK)
        if self.process is not None and self.process.pid is not None:  # started
            self.process.join(SHUTDOWN_GRACE_S)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(SHUTDOWN_GRACE_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        if self.thread is not None:
            self.thread.join(SHUTDOWN_GRACE_S)
        for sock in (self.input_socket, self.output_socket):
            if sock is not None:
                sock.close(linger=0)
        if self.context is not None:
            self.context.term()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


class MPClient:
    """Runs EngineCore behind ZMQ: in a spawned process (the server) or, with
    `in_thread`, in a background thread of this process (fast tests); both
    speak the same msgspec messages (engine/wire.py).

    The constructor only starts the core; `wait_for_ready()` blocks until its
    Ready handshake (raising EngineStartupError on a startup failure, an early
    exit or the timeout), so the caller can load the tokenizer meanwhile.
    """

    # The core's handshake, set by wait_for_ready().
    ready: Ready

    def __init__(self, config: EngineConfig, *, in_thread: bool = False) -> None:
        self.input_encoder = CoreInputEncoder()
        self.output_decoder = CoreOutputDecoder()
        self.dead_error: EngineDeadError | None = None
        # The stats of the last EngineCoreOutputs read (None before the first).
        self.scheduler_stats: SchedulerStats | None = None
        # time.monotonic() of the last message read from the core: proof of life for /health.
        self.last_heard_at = 0.0
        resources = self.resources = _CoreResources()
        self._finalizer = weakref.finalize(self, resources.shutdown)
        try:
            resources.socket_dir = tempfile.mkdtemp(prefix="pagedllm-engine-")
            input_address = f"ipc://{resources.socket_dir}/input"
            output_address = f"ipc://{resources.socket_dir}/output"
            resources.context = zmq.Context()
            resources.input_socket = self.input_socket = resources.context.socket(zmq.PUSH)
            resources.output_socket = self.output_socket = resources.context.socket(zmq.PULL)
            # NOTE: no send high-water mark: a send from the event loop must never block.
            self.input_socket.setsockopt(zmq.SNDHWM, 0)
            self.input_socket.bind(input_address)
            self.output_socket.bind(output_address)
            # The core ignores the server section; the API key stays in this process.
            config_json = config.model_dump_json(exclude={"server"})
            if in_thread:
                resources.thread = threading.Thread(
                    target=run_engine_core,
                    args=(config_json, input_address, output_address, None),
                    name="EngineCore",
                    daemon=True,
                )
                resources.thread.start()
            else:
                context = multiprocessing.get_context("spawn")
                resources.process = context.Process(
                    target=run_engine_core,
                    args=(config_json, input_address, output_address, os.getpid()),
                    name="EngineCore",
                )
                resources.process.start()
        except BaseException:
            self.shutdown()
            raise

    @property
    def engine_pid(self) -> int | None:
        process = self.resources.process
        return None if process is None else process.pid

    def wait_for_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> Ready:
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.output_socket.poll(int(LIVENESS_POLL_S * 1000)):
                    message = self.output_decoder.decode(self.output_socket.recv())
                    if isinstance(message, Ready):
                        self.ready = message
                        self.last_heard_at = time.monotonic()
                        return message
                    if isinstance(message, StartupFailed):
                        raise EngineStartupError(
                            f"engine core failed to start: {message.error_type}: {message.message}",
                            message.error_type,
                        )
                    continue
                if not self._core_alive():
                    raise EngineStartupError(f"engine core exited before it was ready ({self._exit_description()})")
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"engine core not ready after {timeout_s:g} s")
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------- liveness

    @property
    def sentinel(self) -> int | None:
        """A file descriptor that turns readable the moment the core's
        process exits, however it died (None for a core in a thread): what a
        reader watches beside the output socket, whose silence proves nothing."""
        process = self.resources.process
        return None if process is None or process.pid is None else int(process.sentinel)

    def _core_alive(self) -> bool:
        process = self.resources.process
        if process is not None:
            if process.pid is None:  # never started
                return False
            if not multiprocessing.connection.wait([process.sentinel], 0):
                return True
            # NOTE: the sentinel closes a moment before the exit status can be
            # read; wait for it so that the error can name the signal.
            process.join(EXIT_STATUS_WAIT_S)
            return False
        return self.resources.thread is not None and self.resources.thread.is_alive()

    def _exit_description(self) -> str:
        process = self.resources.process
        if process is None:
            return "engine core thread ended"
        code = process.exitcode
        if code is not None and code < 0:
            return f"pid {process.pid} killed by signal {-code}"
        return f"pid {process.pid} exit code {code}"

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core died (a Dead notice or its exit)."""
        if self.dead_error is None and not self._finalizer.alive:
            self.dead_error = EngineDeadError("the engine core was shut down")
        if self.dead_error is None and not self._core_alive():
            self.dead_error = EngineDeadError(f"the engine core died ({self._exit_description()})")
        if self.dead_error is not None:
            raise self.dead_error

    @property
    def errored(self) -> bool:
        try:
            self.check_alive()
        except EngineDeadError:
            return True
        return False

    # ---------------------------------------------------------------- input

    def _send(self, message: CoreInput) -> None:
        self.check_alive()
        try:
            self.input_socket.send(self.input_encoder.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # no peer: the core is gone
            self.check_alive()
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from exc

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def _handle_dead(self, message: EngineDead) -> None:
        self.dead_error = EngineDeadError(
            f"the engine core crashed: {message.error}", failed_rank=message.failed_rank
        )
        raise self.dead_error

    def shutdown(self) -> None:
        """Stop the core (Shutdown message, then SIGTERM, then SIGKILL); idempotent."""
        self._finalizer()


class SyncMPClient(MPClient, EngineCoreClient):
    """EngineCoreClient over ZMQ for blocking callers (an `LLM` with its core
    in another process)."""

    def __init__(self, config: EngineConfig, *, in_thread: bool = False,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        super().__init__(config, in_thread=in_thread)
        self.ready = self.wait_for_ready(startup_timeout_s)
        self._pending_outputs: collections.deque[EngineCoreOutputs] = collections.deque()
        self._call_ids = itertools.count()

    def get_output(self) -> list[EngineCoreOutput]:
        return self.next_outputs().outputs

    @property
    def has_pending_outputs(self) -> bool:
        """Outputs read while a utility call waited, not handed out yet."""
        return bool(self._pending_outputs)

    def next_outputs(self) -> EngineCoreOutputs:
        """The next step's whole message (outputs, stats, KV events), waiting for it."""
        if self._pending_outputs:
            return self._pending_outputs.popleft()
        while True:
            message = self._recv()
            if isinstance(message, EngineCoreOutputs):
                return message

    def _recv(self) -> CoreOutput:
        while not self.output_socket.poll(int(LIVENESS_POLL_S * 1000)):
            self.check_alive()
        message = self.output_decoder.decode(self.output_socket.recv())
        if isinstance(message, EngineDead):
            self._handle_dead(message)
        if isinstance(message, EngineCoreOutputs) and message.scheduler_stats is not None:
            self.scheduler_stats = message.scheduler_stats
        return message

    def call_utility(self, name: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(UtilityRequest(call_id, name, list(args)))
        while True:
            message = self._recv()
            if isinstance(message, UtilityResult) and message.call_id == call_id:
                if message.error is not None:
                    raise RuntimeError(f"engine core utility {name!r} failed: {message.error}")
                return message.result
            if isinstance(message, EngineCoreOutputs):
                self._pending_outputs.append(message)

    def get_stats(self) -> SchedulerStats | None:
        # The core sends fresh stats (read by _recv) before it answers.
        self.call_utility("flush_stats")
        return self.scheduler_stats

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))


class AsyncMPClient(MPClient):
    """The asyncio side: one reader (AsyncLLM's output handler) awaits
    `get_output_async()`, which also resolves utility-call futures; sends
    never block (they are synchronous, so an abort can be sent from a
    `finally` that must not await)."""

    def __init__(self, config: EngineConfig, *, in_thread: bool = False) -> None:
        super().__init__(config, in_thread=in_thread)
        self._async_socket: Any = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._call_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}

    def shutdown(self) -> None:
        async_socket = getattr(self, "_async_socket", None)  # None if __init__ failed early
        if async_socket is not None and not async_socket.closed:
            # Cancels a reader's pending poll/recv before the socket goes away.
            async_socket.close(linger=0)
        super().shutdown()

    def output_socket_for_loop(self) -> Any:
        """The output socket for the running event loop (a DP front end polls several)."""
        loop = asyncio.get_running_loop()
        if self._async_loop is not loop:
            # A new event loop (tests with per-test loops): shadow the socket again.
            self._async_socket = zmq.asyncio.Socket.from_socket(self.output_socket)
            self._async_loop = loop
        return self._async_socket

    async def get_output_async(self, timeout_s: float = LIVENESS_POLL_S) -> EngineCoreOutputs | None:
        """The next step's outputs; None if nothing came within `timeout_s`
        (the core is alive, else EngineDeadError)."""
        sock = self.output_socket_for_loop()
        try:
            while True:
                if not await sock.poll(int(timeout_s * 1000)):
                    self.check_alive()
                    return None
                message = self.output_decoder.decode(await sock.recv())
                self.last_heard_at = time.monotonic()
                if isinstance(message, EngineCoreOutputs):
                    if message.scheduler_stats is not None:
                        self.scheduler_stats = message.scheduler_stats
                    return message
                if isinstance(message, UtilityResult):
                    self._resolve_utility(message)
                elif isinstance(message, EngineDead):
                    self._handle_dead(message)
        except EngineDeadError as exc:
            self._fail_utility_calls(exc)
            raise

    def check_alive(self) -> None:
        """MPClient's, and a dead core's utility calls fail with its error
        (whoever finds it dead: a data-parallel front end no longer reads a
        dead replica's socket)."""
        try:
            super().check_alive()
        except EngineDeadError as exc:
            self._fail_utility_calls(exc)
            raise

    def _fail_utility_calls(self, error: EngineDeadError) -> None:
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
        self._utility_futures.clear()

    def _resolve_utility(self, message: UtilityResult) -> None:
        future = self._utility_futures.pop(message.call_id, None)
        if future is None or future.done():
            return
        if message.error is not None:
            future.set_exception(RuntimeError(f"engine core utility failed: {message.error}"))
        else:
            future.set_result(message.result)

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        """Run an allow-listed utility in the core; needs the output reader running."""
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(UtilityRequest(call_id, name, list(args)))
            return await future
        finally:
            self._utility_futures.pop(call_id, None)
