"""The grammar validator's child process (see validator.py for why it exists).

    python -m pagedllm.structured_output.validator_worker <fd> <parent pid>

Reads requests from the connection on `fd` (msgpack, one per message),
answers each, and exits when the parent closes the connection, dies
(PR_SET_PDEATHSIG plus a parent-pid check) or kills it for running past the
time limit. Requests:

    {"op": "prepare", "backend", "config", "vocab"}  -> {"ok", "note"}
    {"op": "validate", "backend", "config", "vocab", "kind", "spec", "whitespace"}
        -> {"ok": true, "compiled"} | {"ok": false, "field", "value", "limit"}

Messages are msgpack. `compiled`: the backend's `serialize` of the grammar
it compiled (None when it declines): the engine core loads it instead of
compiling the spec again.

`prepare` imports the backend and builds it for `vocab` (tokenizer load,
vocabulary tables: seconds for a large vocab), so the timed `validate`
measures the spec's own cost only.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_DEFAULT_BACKEND_MODULE = "pagedllm.structured_output.xgrammar_backend"


class ValidatorRequestHandler:
    """Answers the parent's requests (prepare, validate) in this child process."""

    def __init__(self) -> None:
        # (backend path, vocab, config json) -> a backend instance, or None
        # when only `validate` can run (no vocab given, or it failed to load).
        self.backends: dict[tuple[str, Any, str], Any] = {}

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "prepare":
            return self.prepare(request)
        return self.validate(request)

    def prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        key = _backend_key(request)
        backend_cls = load_class(request["backend"])  # BackendImportError: the parent validates in-process
        if key in self.backends:
            return {"ok": True, "note": None}
        vocab = request["vocab"]
        backend, note = None, None
        if vocab is not None:
            try:
                backend = build_backend(backend_cls, vocab, request["config"])
            except Exception as exc:  # any failure here falls back to validate() only
                note = f"cannot build the {request['backend']} backend for {vocab[0]!r}: {type(exc).__name__}: {exc}"
        self.backends[key] = backend
        return {"ok": True, "note": note}

    def validate(self, request: dict[str, Any]) -> dict[str, Any]:
        from pagedllm.core.errors import InvalidRequestError
        from pagedllm.structured_output.interface import StructuredOutputKind
        from pagedllm.structured_output.limits import summary
        from pagedllm.structured_output.whitespace import WhitespaceOptions, backend_kwargs

        backend_cls = load_class(request["backend"])
        kind = StructuredOutputKind(request["kind"])
        spec, whitespace = request["spec"], WhitespaceOptions(*request["whitespace"])
        compiled = None
        try:
            backend_cls.validate(kind, spec, **backend_kwargs(backend_cls.validate, whitespace))
            backend = self.backends.get(_backend_key(request))
            if backend is not None:
                # The engine core's own compile: its cost is what the limit bounds.
                grammar = backend.compile(kind, spec, **backend_kwargs(backend.compile, whitespace))
                compiled = backend.serialize(grammar)
        except InvalidRequestError as exc:
            return {"ok": False, "field": exc.field, "value": _plain(exc.value), "limit": exc.limit}
        except Exception as exc:  # a compile error is the spec's fault
            return {
                "ok": False, "field": f"structured_outputs.{kind.value}", "value": summary(spec),
                "limit": f"the {kind.value} does not compile: {_clean(exc)}",
            }
        return {"ok": True, "compiled": compiled}


class BackendImportError(Exception):
    """The backend class cannot be imported by its path here (a class made
    inside a function, a module only the parent can import)."""


def load_class(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise BackendImportError(f"{path}: {type(exc).__name__}: {exc}") from None
    return target


def build_backend(backend_cls: Any, vocab: list[Any], config_json: str) -> Any:
    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.model_registry.tokenizer import load_tokenizer

    tokenizer_path, vocab_size, eos_token_id = vocab
    config = StructuredOutputConfig.model_validate_json(config_json)
    return backend_cls(load_tokenizer(tokenizer_path), vocab_size, eos_token_id, config)


def _backend_key(request: dict[str, Any]) -> tuple[str, Any, str]:
    vocab = request["vocab"]
    return request["backend"], None if vocab is None else tuple(vocab), request["config"]


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def _clean(exc: BaseException) -> str:
    from pagedllm.structured_output.xgrammar_backend import clean_error

    return clean_error(exc)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        # NOTE: fires when the parent *thread* that spawned us exits; the
        # parent notices a dead child and spawns another.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(0)


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[1]), int(argv[2])
    _die_with_parent(parent_pid)
    # Ctrl-C in a terminal reaches the whole process group: the parent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    with contextlib.suppress(ImportError):
        importlib.import_module(_DEFAULT_BACKEND_MODULE)  # the slow imports, before "ready"
    worker = ValidatorRequestHandler()
    conn.send_bytes(msgspec.msgpack.encode({"ready": True}))
    while True:
        try:
            request = msgspec.msgpack.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply = worker.handle(request)
        except BackendImportError as exc:
            reply = {"ok": False, "import_error": str(exc)}
        conn.send_bytes(msgspec.msgpack.encode(reply))


if __name__ == "__main__":
    main(sys.argv)
