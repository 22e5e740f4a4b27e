"""ValidatorChild: one grammar-validation child process and the exchange with
it, one spec at a time (the lane in validator.py decides which spec).

Why a process: a grammar compile (xgrammar's C++, llguidance's Rust) cannot
be interrupted, and a thread past its deadline would keep burning a core.

The child is spawned lazily with `python -m` (no re-import of the user's
`__main__`, unlike multiprocessing's spawn), reused, started again after a
kill, closed at exit, and dies with its parent (PR_SET_PDEATHSIG). Messages
are msgpack (a compiled grammar travels back as bytes).

A spec runs under two clocks: `checkpoint_s` (the lane's cheap budget), where
the lane may let it go on or take it back (the child is killed: the spec is
run again in the costly lane), and `timeout_s`
(structured_output.compile_timeout_s), past which it is refused.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pagedllm.core.errors import InvalidRequestError
from pagedllm.structured_output.limits import summary
from pagedllm.structured_output.whitespace import WhitespaceOptions, backend_kwargs

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagedllm.structured_output.interface import GrammarBackend

logger = logging.getLogger(__name__)

WORKER_MODULE = "pagedllm.structured_output.validator_worker"
# Start-up (imports) and `prepare` (tokenizer, vocab tables) are not the
# spec's cost: they get their own, generous limit.
WORKER_START_TIMEOUT_S = 300.0


class Refusal(NamedTuple):
    field: str
    value: Any
    limit: str
    # A timeout or a crash: also a matter of the machine's load, so not remembered for good.
    transient: bool = False


class ChildReply(NamedTuple):
    """What one spec came to: refused (or None), the compiled grammar the
    backend serialized (or None), and whether the lane took it back."""

    refusal: Refusal | None
    compiled: bytes | None = None
    preempted: bool = False


class _WorkerGone(Exception):
    """The child exited while it held a spec (a crash on it, or a stray signal)."""


class _WorkerStartError(_WorkerGone):
    """The child could not start or prepare: never the spec's fault."""


_PREEMPTED = object()


class ValidatorChild:
    """One child process (started on first use) and the exchange with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False
        # Prepared (backend, vocab, config) keys of the current child; False =
        # the child cannot import that backend (validated in-process instead).
        self._prepared: dict[tuple[Any, ...], bool] = {}
        self._closed = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def run(
        self, backend_cls: type[GrammarBackend], request: dict[str, Any], timeout_s: float,
        checkpoint_s: float | None = None, on_checkpoint: Callable[[], bool] | None = None,
    ) -> ChildReply:
        """Validate (and compile, given a vocab) `request` in the child.
        `on_checkpoint` is called once if the spec is still running after
        `checkpoint_s`; False takes it back (ChildReply.preempted)."""
        with self._lock:
            return self._run_locked(backend_cls, request, timeout_s, checkpoint_s, on_checkpoint)

    def warm(self, backend_cls: type[GrammarBackend], request: dict[str, Any]) -> None:
        """Start the child if it is not running and get `request`'s backend
        ready in it (imports, tokenizer, vocab tables), so the next spec
        pays only for itself. A failure here is retried by the next `run`."""
        with self._lock:
            if self._closed:
                return
            try:
                self._ensure_child()
                self._prepare(request)
            except _WorkerGone as exc:
                logger.warning("grammar validator child failed to start: %s", exc)
                self._stop_child()

    def _run_locked(
        self, backend_cls: type[GrammarBackend], request: dict[str, Any], timeout_s: float,
        checkpoint_s: float | None, on_checkpoint: Callable[[], bool] | None,
    ) -> ChildReply:
        kind, spec = request["kind"], request["spec"]
        for attempt in (1, 2):
            try:
                return self._run_in_child(backend_cls, request, timeout_s, checkpoint_s, on_checkpoint)
            except _WorkerStartError as exc:
                self._stop_child()
                if attempt == 2 or self._closed:
                    logger.error("grammar validator child unavailable (%s); validating in-process", exc)
                    return ChildReply(validate_in_process(backend_cls, kind, spec, request["whitespace"]))
            except _WorkerGone as exc:
                # Once more on a fresh child: it may have died for its own reasons
                # (PDEATHSIG when the thread that spawned it ended).
                self._stop_child()
                if self._closed:
                    return ChildReply(Refusal(f"structured_outputs.{kind}", summary(spec),
                                              "the grammar validator is shutting down", transient=True))
                if attempt == 2:
                    logger.error("grammar validator child died twice on one %s spec: %s", kind, exc)
                    return ChildReply(Refusal(f"structured_outputs.{kind}", summary(spec),
                                              f"the grammar validator process crashed on it ({exc})", transient=True))
        raise AssertionError("not reached")

    def _run_in_child(
        self, backend_cls: type[GrammarBackend], request: dict[str, Any], timeout_s: float,
        checkpoint_s: float | None, on_checkpoint: Callable[[], bool] | None,
    ) -> ChildReply:
        if not self._prepare(request):
            return ChildReply(validate_in_process(backend_cls, request["kind"], request["spec"],
                                                  request["whitespace"]))
        reply = self._exchange({**request, "op": "validate"}, timeout_s, checkpoint_s, on_checkpoint)
        if reply is None or reply is _PREEMPTED:
            # NOTE: killed, not abandoned: nothing keeps compiling it.
            self._stop_child()
            self._start_child()  # warms up while the caller gets its answer
            if reply is _PREEMPTED:
                return ChildReply(None, preempted=True)
            return ChildReply(Refusal(
                f"structured_outputs.{request['kind']}", summary(request["spec"]),
                f"validating and compiling it took longer than structured_output.compile_timeout_s = {timeout_s:g} s",
                transient=True,
            ))
        assert isinstance(reply, dict)
        if reply["ok"]:
            return ChildReply(None, reply.get("compiled"))
        return ChildReply(Refusal(reply["field"], reply["value"], reply["limit"]))

    def _prepare(self, request: dict[str, Any]) -> bool:
        """True once the child has the backend ready for `request`; False if
        the child cannot import it."""
        key = (request["backend"], request["vocab"], request["config"])
        if key not in self._prepared:
            message = {name: request[name] for name in ("backend", "config", "vocab")}
            try:
                reply = self._exchange({**message, "op": "prepare"}, WORKER_START_TIMEOUT_S)
            except _WorkerGone as exc:
                raise _WorkerStartError(str(exc)) from None
            if not isinstance(reply, dict):
                raise _WorkerStartError(f"no answer to prepare within {WORKER_START_TIMEOUT_S:g} s")
            if reply.get("import_error"):
                logger.warning("grammar backend %s validated in-process (no time limit): %s",
                               request["backend"], reply["import_error"])
            elif reply.get("note"):
                logger.warning("grammar validation without compiling: %s", reply["note"])
            self._prepared[key] = bool(reply["ok"])
        return self._prepared[key]

    def _exchange(
        self, message: dict[str, Any], timeout_s: float, checkpoint_s: float | None = None,
        on_checkpoint: Callable[[], bool] | None = None,
    ) -> dict[str, Any] | object | None:
        """The child's reply; None past `timeout_s`; _PREEMPTED if `on_checkpoint` said stop."""
        conn = self._ensure_child()
        try:
            conn.send_bytes(msgspec.msgpack.encode(message))
            if checkpoint_s is not None and on_checkpoint is not None and checkpoint_s < timeout_s:
                if not conn.poll(checkpoint_s):
                    if not on_checkpoint():
                        return _PREEMPTED
                    if not conn.poll(timeout_s - checkpoint_s):
                        return None
            elif not conn.poll(timeout_s):
                return None
            reply: dict[str, Any] = msgspec.msgpack.decode(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise _WorkerGone(self._exit_reason(exc)) from None
        return reply

    def _ensure_child(self) -> Connection:
        if self._closed:
            raise _WorkerStartError("the validator is closed")
        if self._proc is not None and self._proc.poll() is not None:
            self._stop_child()  # died while idle
        if self._proc is None:
            self._start_child()
        assert self._conn is not None
        if not self._ready:
            try:
                if not self._conn.poll(WORKER_START_TIMEOUT_S):
                    raise _WorkerStartError(f"not ready within {WORKER_START_TIMEOUT_S:g} s")
                msgspec.msgpack.decode(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise _WorkerStartError(self._exit_reason(exc)) from None
            self._ready = True
        return self._conn

    def _start_child(self) -> None:
        parent_conn, child_conn = multiprocessing.Pipe()
        fd = child_conn.fileno()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(fd), str(os.getpid())],
            pass_fds=(fd,), stdin=subprocess.DEVNULL,
        )
        child_conn.close()
        self._conn, self._ready = parent_conn, False
        self._prepared.clear()

    def _stop_child(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._ready = None, None, False
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait(timeout=10)

    def _exit_reason(self, exc: BaseException) -> str:
        proc = self._proc
        if proc is not None:
            try:
                return f"the child exited with code {proc.wait(timeout=1)}"
            except subprocess.TimeoutExpired:
                pass
        return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # a spec in progress ends now, not when it finishes
        with self._lock:
            self._stop_child()


def validate_in_process(
    backend_cls: type[GrammarBackend], kind: str, spec: str, whitespace: WhitespaceOptions | list[Any]
) -> Refusal | None:
    from pagedllm.structured_output.interface import StructuredOutputKind

    try:
        backend_cls.validate(StructuredOutputKind(kind), spec,
                             **backend_kwargs(backend_cls.validate, WhitespaceOptions(*whitespace)))
    except InvalidRequestError as exc:
        return Refusal(exc.field, exc.value, exc.limit)
    return None
