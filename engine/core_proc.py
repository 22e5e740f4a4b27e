"""The engine core in its own process: a busy loop around EngineCore.step().

    drain the input socket (add / abort / utility) -> step() if there is work
    -> send that step's outputs and scheduler stats -> block on input when idle

The API process (AsyncLLM, the HTTP server) tokenizes and detokenizes; this
process only schedules and runs the model, so the two overlap. Messages are
msgspec structs (engine/wire.py), never pickles.

Lifetime: spawned by `MPClient` (engine/core_client.py) with the "spawn" context;
exits on a Shutdown message, on SIGTERM / SIGINT, and when its parent dies
(PR_SET_PDEATHSIG plus a parent-pid check), so a killed server leaves no
orphan. A crash in the loop is reported with an EngineDead message first;
so is a rank of the executor that dies (noticed by the step that needs it,
or by the executor's health check every idle poll).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from pagedllm.core.errors import PagedLLMError
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.startup_heap import freeze_startup_heap
from pagedllm.engine.wire import (
    AbortRequests,
    AddRequests,
    CoreInputDecoder,
    CoreOutputEncoder,
    EngineCoreOutputs,
    EngineDead,
    Ready,
    Shutdown,
    StartupFailed,
    UtilityRequest,
    UtilityResult,
    from_engine_core_request,
)
from pagedllm.executors.base import RankFailedError

if TYPE_CHECKING:
    from pagedllm.core.engine import EngineCore
    from pagedllm.engine.builder import EngineParts

logger = logging.getLogger(__name__)

# How long an idle core blocks on its input before it checks its parent.
IDLE_POLL_MS = 1000
# How often the core checks its parent (PDEATHSIG is the fast path) and,
# while idle, its executor's health: on a clock, so that input arriving more
# often (a /health probe's pings) cannot starve the checks.
CHECK_INTERVAL_S = 1.0
# How long the core's last message may wait for the API to read it.
LAST_WORD_LINGER_MS = 2000
_PR_SET_PDEATHSIG = 1


class EngineCoreProc:
    """Runs an EngineCore against a pair of ZMQ sockets."""

    # NOTE: the only names a UtilityRequest may call; never getattr() a client's string.
    UTILITIES = frozenset({"flush_stats", "reset_prefix_cache", "ping", "memory_usage", "gc_stats"})

    def __init__(
        self,
        engine_core: EngineCore,
        input_socket: zmq.Socket[bytes],
        output_socket: zmq.Socket[bytes],
        parent_pid: int | None = None,
        check_health: Callable[[], None] | None = None,
        memory_usage: Callable[[], list[dict[str, int]]] | None = None,
    ) -> None:
        self.engine_core = engine_core
        # Each rank's Worker.memory_usage() (the executor's collective call).
        self.memory_usage = memory_usage
        # The executor's liveness check (a dead rank raises), run while idle:
        # a busy core learns of a dead rank from its step.
        self.check_health = check_health
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.decoder = CoreInputDecoder()
        self.encoder = CoreOutputEncoder()
        self.should_stop = False
        # Queue lengths changed without a step (an abort while idle): the
        # API's gauges must hear about it.
        self.stats_dirty = False
        self._last_check = time.monotonic()

    # ------------------------------------------------------------------ loop

    def run_busy_loop(self) -> None:
        engine_core = self.engine_core
        while not self.should_stop:
            self._process_input_queue(block=not engine_core.has_unfinished_requests())
            if self.should_stop:
                break
            if engine_core.has_unfinished_requests():
                result = engine_core.step()
                self._send_outputs(result.outputs, result.num_scheduled_tokens)
                if not result.made_progress:
                    engine_core.wait_for_work()  # only grammars compiling: no spinning
            elif self.stats_dirty:
                self._send_outputs([], 0)

    def _process_input_queue(self, block: bool) -> None:
        if block:
            while not self.input_socket.poll(IDLE_POLL_MS):
                self._maybe_run_checks(idle=True)
                # A heartbeat: an idle core is heard from every IDLE_POLL_MS, so
                # the API's /health answers without a round trip while the
                # loop runs, and stops answering 200 when it does not.
                self._send_outputs([], 0)
        # A busy core learns of a dead rank from its step; an idle one here.
        self._maybe_run_checks(idle=block)
        while not self.should_stop:
            try:
                frame = self.input_socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle_input(self.decoder.decode(frame.buffer))

    def _handle_input(self, message: Any) -> None:
        if isinstance(message, AddRequests):
            for wire_request in message.requests:
                self._add_request(wire_request)
        elif isinstance(message, AbortRequests):
            self.engine_core.abort_requests(message.request_ids)
            self.stats_dirty = True
        elif isinstance(message, UtilityRequest):
            self._send(self._call_utility(message))
        elif isinstance(message, Shutdown):
            self.should_stop = True

    def _add_request(self, wire_request: Any) -> None:
        try:
            self.engine_core.add_request(from_engine_core_request(wire_request))
        except (PagedLLMError, TypeError, ValueError) as exc:
            # The API validates first, so this is a client bug or a race;
            # it ends the one request, never the loop.
            logger.warning("request %s rejected by the engine core: %s", wire_request.request_id, exc)
            rejected = EngineCoreOutput(wire_request.request_id, [], finish_reason="abort")
            self._send(EngineCoreOutputs([rejected], None, 0, time.time()))

    def _call_utility(self, message: UtilityRequest) -> UtilityResult:
        if message.name not in self.UTILITIES:
            return UtilityResult(message.call_id, None, f"UnknownUtility: {message.name!r}")
        try:
            result = getattr(self, "utility_" + message.name)(*message.args)
        except Exception as exc:  # reported to the caller, the loop goes on
            return UtilityResult(message.call_id, None, f"{type(exc).__name__}: {exc}")
        return UtilityResult(message.call_id, result)

    def _send_outputs(self, outputs: list[EngineCoreOutput], num_scheduled_tokens: int) -> None:
        self.stats_dirty = False
        message = EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.engine_core.make_stats(),
            num_scheduled_tokens=num_scheduled_tokens,
            timestamp=time.time(),
            kv_events=self.engine_core.take_kv_events(),
        )
        self._send(message)

    def _send(self, message: Any) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    # ------------------------------------------------------------- utilities

    def utility_flush_stats(self) -> None:
        # The stats go out the one way they always do (an EngineCoreOutputs,
        # read before this answer: same socket, in order), so the interval
        # counts reach the metrics pipeline as well as the caller.
        self._send_outputs([], 0)

    def utility_reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def utility_memory_usage(self) -> list[dict[str, int]]:
        return self.memory_usage() if self.memory_usage is not None else []

    def utility_gc_stats(self) -> dict[str, int]:
        """Objects the garbage collector scans, and those start-up froze."""
        return {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count()}

    def utility_ping(self) -> str:
        # NOTE: the answer only proves the busy loop turns (between steps);
        # it must stay free of work so /health measures the loop, not itself.
        return "pong"

    # ---------------------------------------------------------------- parent

    def _maybe_run_checks(self, idle: bool) -> None:
        now = time.monotonic()
        if now - self._last_check >= CHECK_INTERVAL_S:
            self._last_check = now
            self._check_parent()
            if idle and self.check_health is not None:
                self.check_health()

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("parent process %d is gone; engine core exiting", self.parent_pid)
            self.should_stop = True
            raise SystemExit(0)


# --------------------------------------------------------------- entry point


def run_engine_core(
    config_json: str,
    input_address: str,
    output_address: str,
    parent_pid: int | None = None,
) -> None:
    """Target of the engine-core process (`parent_pid` set) or thread (None).

    Connects to the API's sockets, builds the EngineCore, answers Ready (or
    StartupFailed), then runs the busy loop until told to stop.
    """
    in_own_process = parent_pid is not None
    if parent_pid is not None:
        _setup_process(parent_pid)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    output_socket = context.socket(zmq.PUSH)
    input_socket.connect(input_address)
    output_socket.connect(output_address)
    encoder = CoreOutputEncoder()
    exit_code = 0
    # Only a last word (StartupFailed, EngineDead) is worth waiting to deliver;
    # step outputs after a Shutdown have no reader.
    output_linger_ms = 0
    try:
        try:
            parts = _build_engine(config_json)
        except Exception as exc:  # sent back to the parent as StartupFailed
            logger.exception("engine core failed to start")
            output_socket.send(encoder.encode(StartupFailed(type(exc).__name__, str(exc))))
            output_linger_ms = LAST_WORD_LINGER_MS
            exit_code = 1
            return
        output_socket.send(encoder.encode(ready_message(parts)))
        if in_own_process:
            freeze_startup_heap()  # never the host's heap, when the core is a thread of it
        proc = EngineCoreProc(
            parts.engine_core, input_socket, output_socket, parent_pid, check_health=parts.executor.check_health,
            memory_usage=lambda: parts.executor.collective_rpc("memory_usage"),
        )
        if _serve(proc, parts, output_socket, encoder):
            output_linger_ms, exit_code = LAST_WORD_LINGER_MS, 1
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=output_linger_ms)
        context.term()
        if in_own_process and exit_code:
            sys.exit(exit_code)


def _serve(
    proc: EngineCoreProc, parts: EngineParts, output_socket: zmq.Socket[bytes], encoder: CoreOutputEncoder
) -> bool:
    """The busy loop until it stops; True when it crashed (EngineDead sent,
    naming the failed rank when one ended it). However it ends, the
    executor's workers stop with it, after the EngineDead: the API hears of
    a death first."""
    try:
        proc.run_busy_loop()
    except SystemExit:
        logger.info("engine core stopping (signal or parent exit)")
    except BaseException as exc:
        logger.exception("engine core busy loop crashed")
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        dead = EngineDead(error, failed_rank=exc.rank if isinstance(exc, RankFailedError) else None)
        with contextlib.suppress(zmq.ZMQError):
            output_socket.send(encoder.encode(dead), flags=zmq.NOBLOCK)
        return True
    finally:
        parts.engine_core.shutdown()
        parts.executor.shutdown()
    return False


def _build_engine(config_json: str) -> EngineParts:
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.builder import build_engine

    # Every field is given, so PAGEDLLM_ env cannot change what the parent decided.
    return build_engine(EngineConfig(**json.loads(config_json)))


def ready_message(parts: EngineParts) -> Ready:
    """The core's figures a client needs (the in-process client builds the same)."""
    from pagedllm.model_registry.tokenizer import config_eos_token_id

    engine_core = parts.engine_core
    return Ready(
        pid=os.getpid(),
        model_path=parts.model.path,
        max_model_len=engine_core.max_model_len,
        vocab_size=engine_core.vocab_size,
        num_kv_blocks=parts.num_blocks,
        block_size=engine_core.config.cache.block_size,
        eos_token_id=config_eos_token_id(parts.model.hf_config),
        attention_backend=parts.attn_selection.name,
        executor=parts.executor_name,
        world_size=engine_core.config.parallel.tensor_parallel_size,
        communicator=parts.platform.describe_communicator(),
        custom_metrics=engine_core.custom_stats.metrics if engine_core.custom_stats is not None else [],
        generation=parts.generation,
        lora_modules=parts.executor.lora_supported_modules() if engine_core.config.lora.enable_lora else None,
    )


def _setup_process(parent_pid: int) -> None:
    """Die with the parent, exit cleanly on SIGTERM / SIGINT, log like the parent."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").upper(),
            format=f"%(levelname)s %(asctime)s [EngineCore pid={os.getpid()}] %(name)s: %(message)s",
        )

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            # NOTE: fires when the parent *thread* that spawned us exits; the
            # client spawns from the thread that owns the engine (main / loop).
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid check")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(0)
