"""GrammarValidator: the API-side check of a spec, run in a child process
that is killed and replaced when it takes longer than
`structured_output.compile_timeout_s`.

Why a process: a grammar compile (xgrammar's C++, llguidance's Rust) cannot
be interrupted, and a thread past its deadline would keep burning a core.

What the child runs: the backend's `validate` and, when the caller names the
model's vocabulary (GrammarVocab), the very `compile` the engine core will
run later. Parsing alone is no proxy for the core's cost: measured with
xgrammar 0.2.9 on this machine, the regex `(a|b|c|d|e|f|g|h)` x 2000 parses
in 0.045 s but compiles in 2.9 s against an 8k vocabulary; `.{0,5000}`
parses in 0 s and compiles in 0.44 s (8k) and 6.8 s (128k). Only for JSON
schemas do parse and compile track each other (depth 200: 0.78 s both).
So "passed within the limit" bounds the core's compile only with a vocab;
without one (a caller that has none) it bounds the parse.

The child is spawned lazily with `python -m` (no re-import of the user's
`__main__`, unlike multiprocessing's spawn), reused, started again after a
kill, closed at exit, and dies with its parent (PR_SET_PDEATHSIG). Each
child takes one spec at a time; a second child starts only while the first
is busy (DEFAULT_MAX_CHILDREN), so one client's costly spec does not hold up
the others'. Results are cached by spec, shared by all children, so a
repeated schema never reaches a child again.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pagedllm.core.errors import InvalidRequestError
from pagedllm.structured_output.limits import summary
from pagedllm.structured_output.whitespace import WhitespaceOptions, backend_kwargs

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.structured_output.interface import GrammarBackend, StructuredOutputKind

logger = logging.getLogger(__name__)

WORKER_MODULE = "pagedllm.structured_output.validator_worker"
# Start-up (imports) and `prepare` (tokenizer, vocab tables) are not the
# spec's cost: they get their own, generous limit.
WORKER_START_TIMEOUT_S = 300.0
# Validation children at most: one client's costly spec then holds up only
# its own child while the next one serves the others (each is ~300 MB with
# torch imported, started only when every other is busy).
DEFAULT_MAX_CHILDREN = 2
# Validation results kept (passed or refused), least recently used dropped.
RESULT_CACHE_SIZE = 1024
# How long a timeout (or a crash) is remembered: long enough that a client
# repeating a costly spec cannot keep the child busy, short enough that a
# spec refused while the machine was loaded can be tried again.
TRANSIENT_MEMORY_S = 60.0


class GrammarVocab(NamedTuple):
    """What the engine core compiles against, so the child compiles the same."""

    tokenizer: str  # a folder or hub id for `load_tokenizer`
    vocab_size: int  # the model's (the logits' width)
    eos_token_id: int | None

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> GrammarVocab:
        """From a loaded HF tokenizer (the folder or id it was loaded from)."""
        return cls(str(tokenizer.name_or_path), vocab_size, eos_token_id)


class _Refusal(NamedTuple):
    field: str
    value: Any
    limit: str
    # A timeout or a crash: also a matter of the machine's load, so not remembered for good.
    transient: bool = False


class _WorkerGone(Exception):
    """The child exited while it held a spec (a crash on it, or a stray signal)."""


class _WorkerStartError(_WorkerGone):
    """The child could not start or prepare: never the spec's fault."""


class GrammarValidator:
    """The validation children (at most `max_children`, each started on
    demand) and the results they produced, shared by every thread.

    NOTE: several children so that one client's costly spec (up to
    compile_timeout_s) does not hold up everyone else's: a second child
    starts only while the first is busy, and the most recently used idle
    child serves next, so a quiet server keeps one warm process.
    """

    def __init__(self, max_children: int = DEFAULT_MAX_CHILDREN) -> None:
        self._idle: queue.LifoQueue[_ValidatorChild] = queue.LifoQueue()
        self._children = [_ValidatorChild() for _ in range(max(1, max_children))]
        for child in reversed(self._children):
            self._idle.put(child)
        # key -> (refusal or None, monotonic time it is forgotten)
        self._results: OrderedDict[tuple[Any, ...], tuple[_Refusal | None, float]] = OrderedDict()
        self._results_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The pid of the first child (the one a quiet server uses)."""
        return self._children[0].pid

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children if child.pid is not None]

    def validate(
        self,
        backend_cls: type[GrammarBackend],
        kind: StructuredOutputKind,
        spec: str,
        whitespace: WhitespaceOptions,
        config: StructuredOutputConfig,
        vocab: GrammarVocab | None = None,
    ) -> None:
        """InvalidRequestError if `spec` does not validate (and compile, with
        `vocab`) within config.compile_timeout_s; blocks; thread-safe."""
        key = (_class_path(backend_cls), kind.value, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).digest(),
               tuple(whitespace), vocab, config.model_dump_json())
        with self._results_lock:
            result, forget_at = self._results.get(key, (None, 0.0))
            hit = time.monotonic() < forget_at
            if hit:
                self._results.move_to_end(key)
        if not hit:
            child = self._idle.get()
            try:
                result = child.validate(backend_cls, kind, spec, whitespace, config, vocab)
            finally:
                self._idle.put(child)
            forget_at = time.monotonic() + TRANSIENT_MEMORY_S if result and result.transient else float("inf")
            with self._results_lock:
                self._results[key] = (result, forget_at)
                self._results.move_to_end(key)
                while len(self._results) > RESULT_CACHE_SIZE:
                    self._results.popitem(last=False)
        if result is not None:
            raise InvalidRequestError(result.field, result.value, result.limit)

    def close(self) -> None:
        for child in self._children:
            child.close()


class _ValidatorChild:
    """One child process and the exchange with it (one spec at a time)."""

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

    def validate(
        self, backend_cls: type[GrammarBackend], kind: StructuredOutputKind, spec: str, whitespace: WhitespaceOptions,
        config: StructuredOutputConfig, vocab: GrammarVocab | None,
    ) -> _Refusal | None:
        with self._lock:
            return self._validate_locked(backend_cls, kind, spec, whitespace, config, vocab)

    def _validate_locked(
        self, backend_cls: type[GrammarBackend], kind: StructuredOutputKind, spec: str, whitespace: WhitespaceOptions,
        config: StructuredOutputConfig, vocab: GrammarVocab | None,
    ) -> _Refusal | None:
        request = {"backend": _class_path(backend_cls), "config": config.model_dump_json(), "vocab": vocab,
                   "kind": kind.value, "spec": spec, "whitespace": whitespace}
        for attempt in (1, 2):
            try:
                return self._validate_in_child(backend_cls, request, config.compile_timeout_s)
            except _WorkerStartError as exc:
                self._stop_child()
                if attempt == 2 or self._closed:
                    logger.error("grammar validator child unavailable (%s); validating in-process", exc)
                    return _validate_in_process(backend_cls, kind.value, spec, whitespace)
            except _WorkerGone as exc:
                # Once more on a fresh child: it may have died for its own reasons
                # (PDEATHSIG when the thread that spawned it ended).
                self._stop_child()
                if attempt == 2:
                    logger.error("grammar validator child died twice on one %s spec: %s", kind.value, exc)
                    return _Refusal(f"structured_outputs.{kind.value}", summary(spec),
                                    f"the grammar validator process crashed on it ({exc})", transient=True)
        return None  # not reached

    def _validate_in_child(
        self, backend_cls: type[GrammarBackend], request: dict[str, Any], timeout_s: float
    ) -> _Refusal | None:
        if not self._prepare(request):
            return _validate_in_process(backend_cls, request["kind"], request["spec"], request["whitespace"])
        reply = self._exchange({**request, "op": "validate"}, timeout_s)
        if reply is None:
            # NOTE: killed, not abandoned: nothing keeps compiling it.
            self._stop_child()
            self._start_child()  # warms up while the caller gets its answer
            return _Refusal(
                f"structured_outputs.{request['kind']}", summary(request["spec"]),
                f"validating and compiling it took longer than structured_output.compile_timeout_s = {timeout_s:g} s",
                transient=True,
            )
        if reply["ok"]:
            return None
        return _Refusal(reply["field"], reply["value"], reply["limit"])

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
            if reply is None:
                raise _WorkerStartError(f"no answer to prepare within {WORKER_START_TIMEOUT_S:g} s")
            if reply.get("import_error"):
                logger.warning("grammar backend %s validated in-process (no time limit): %s",
                               request["backend"], reply["import_error"])
            elif reply.get("note"):
                logger.warning("grammar validation without compiling: %s", reply["note"])
            self._prepared[key] = bool(reply["ok"])
        return self._prepared[key]

    def _exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The child's reply, or None if it took longer than `timeout_s`."""
        conn = self._ensure_child()
        try:
            conn.send_bytes(msgspec.json.encode(message))
            if not conn.poll(timeout_s):
                return None
            reply: dict[str, Any] = msgspec.json.decode(conn.recv_bytes())
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
                msgspec.json.decode(self._conn.recv_bytes())
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
        with self._lock:
            self._closed = True
            self._stop_child()


def _class_path(backend_cls: type) -> str:
    return f"{backend_cls.__module__}:{backend_cls.__qualname__}"


def _validate_in_process(
    backend_cls: type[GrammarBackend], kind: str, spec: str, whitespace: WhitespaceOptions
) -> _Refusal | None:
    from pagedllm.structured_output.interface import StructuredOutputKind

    try:
        backend_cls.validate(StructuredOutputKind(kind), spec, **backend_kwargs(backend_cls.validate, whitespace))
    except InvalidRequestError as exc:
        return _Refusal(exc.field, exc.value, exc.limit)
    return None


_default: GrammarValidator | None = None
_default_lock = threading.Lock()


def get_validator() -> GrammarValidator:
    """This process's validator (its child starts on the first validation)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = GrammarValidator()
            atexit.register(shutdown_validator)
        return _default


def shutdown_validator() -> None:
    """Stop this process's validator child (at exit; a later call starts another)."""
    global _default
    with _default_lock:
        validator, _default = _default, None
    if validator is not None:
        validator.close()

