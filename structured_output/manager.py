"""StructuredOutputManager: compiles grammars off the engine loop and builds
each step's bitmask.

    add_request -> grammar_init(request)   # submit (or hit the LRU cache)
    schedule()  -> is_ready(request)       # WAITING_FOR_FSM until compiled;
                                           # the rest of the batch runs meanwhile
                -> grammar_bitmask(...)    # one row per sampled position
    update_from_output -> accept_tokens    # advance with the accepted tokens

A compiled grammar is cached once per (backend, kind, spec, any_whitespace),
as a never-advanced Grammar that every request forks; in-flight compiles are
shared too, so a burst of identical schemas compiles once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedllm.core.errors import InvalidRequestError, PagedLLMError
from pagedllm.structured_output.bitmask import allocate_token_bitmask
from pagedllm.structured_output.interface import Grammar, GrammarBackend, StructuredOutputKind

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.core.request import Request
    from pagedllm.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarKey(NamedTuple):
    backend: str
    kind: StructuredOutputKind
    spec: str
    any_whitespace: bool


@dataclass
class StructuredOutputRequest:
    """A request's grammar: compiling (future), ready (grammar) or failed (error)."""

    key: GrammarKey
    future: Future[Grammar]
    grammar: Grammar | None = None
    error: str | None = None

    def is_ready(self) -> bool:
        """True once compiled or failed; forks the cached Grammar on first success."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = f"structured output ({self.key.backend}, {self.key.kind.value}) failed to compile: " + (
                str(exc) if isinstance(exc, PagedLLMError) else f"{type(exc).__name__}: {exc}"
            )
            return True
        self.grammar = self.future.result().fork()
        return True


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def backend_class(name: str) -> type[GrammarBackend]:
    """The registered GrammarBackend class `name` (InvalidRequestError if none)."""
    from pagedllm.plugins import GRAMMAR_BACKEND, get_plugin_manager

    registry = get_plugin_manager().registry(GRAMMAR_BACKEND)
    if name not in registry:
        raise InvalidRequestError(
            "structured_outputs.backend", name, "registered grammar backends: " + ", ".join(sorted(registry.names()))
        )
    backend_cls = registry.load(name)
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, GrammarBackend)):
        raise PagedLLMError(f"grammar backend {name!r} is not a GrammarBackend subclass: {backend_cls!r}")
    return backend_cls


def validate_structured_outputs(params: StructuredOutputsParams, config: StructuredOutputConfig) -> None:
    """The API-side check before scheduling: the backend exists and compiles the spec."""
    kind, spec = params.grammar_spec()
    backend_name = params.backend or config.backend
    backend_cls = backend_class(backend_name)
    if kind not in backend_cls.supported_kinds:
        raise InvalidRequestError(
            f"structured_outputs.{kind.value}", spec[:200],
            f"the {backend_name} backend does not support {kind.value}; it supports "
            + ", ".join(sorted(k.value for k in backend_cls.supported_kinds)),
        )
    backend_cls.validate(kind, spec, any_whitespace=not (params.disable_any_whitespace or config.disable_any_whitespace))


class StructuredOutputManager:
    def __init__(
        self,
        config: StructuredOutputConfig,
        *,
        vocab_size: int,
        tokenizer: str | Any,
        eos_token_id: int | None,
        max_num_rows: int,
    ) -> None:
        """`tokenizer`: a loaded HF tokenizer or the folder to load it from,
        lazily, when the first backend is built (the core needs it only for
        structured output)."""
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = tokenizer
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[GrammarKey, Future[Grammar]] = OrderedDict()
        self._pending: set[Future[Grammar]] = set()
        self.stats = CacheStats()
        # Reused every step; grows when a step needs more rows (drafts).
        self._bitmask = allocate_token_bitmask(max_num_rows, vocab_size)

    # ------------------------------------------------------------- compile

    def grammar_init(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        kind, spec = params.grammar_spec()
        any_whitespace = not (params.disable_any_whitespace or self.config.disable_any_whitespace)
        key = GrammarKey(params.backend or self.config.backend, kind, spec, any_whitespace)
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.config.num_compile_threads, thread_name_prefix="pagedllm-grammar"
                )
            future = self._executor.submit(self._compile, key)
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            if self.config.cache_size > 0:
                self._cache[key] = future
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        request.structured_output_request = StructuredOutputRequest(key, future)

    def _compile(self, key: GrammarKey) -> Grammar:
        import time

        backend = self._get_backend(key.backend)
        start = time.perf_counter()
        grammar = backend.compile(key.kind, key.spec, any_whitespace=key.any_whitespace)
        self.stats.compile_seconds.append(time.perf_counter() - start)
        return grammar

    def _get_backend(self, name: str) -> GrammarBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = backend_class(name)(self.tokenizer, self.vocab_size, self.eos_token_id, self.config)
                self._backends[name] = backend
            return backend

    @property
    def tokenizer(self) -> Any:
        # NOTE: called under self._lock (first backend build), on a compile thread.
        if isinstance(self._tokenizer, str):
            from pagedllm.core.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer)
        return self._tokenizer

    def has_pending_compiles(self) -> bool:
        return bool(self._pending)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until any compile finishes or `timeout_s` passes (an idle
        engine must not spin while it waits for grammars)."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------- bitmask

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> torch.Tensor | None:
        """Rows for every sampled position of the listed requests, in order:
        1 + len(drafts) rows per request (row j: the grammar state after the
        first j drafts). Drafts are accepted to fill the next row, then
        rolled back, so the grammars end where they started."""
        if not structured_output_request_ids:
            return None
        num_rows = sum(1 + len(scheduled_spec_decode_tokens.get(r, ())) for r in structured_output_request_ids)
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = allocate_token_bitmask(num_rows, self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        bitmask.fill_(-1)
        row = 0
        for request_id in structured_output_request_ids:
            so_request = requests[request_id].structured_output_request
            grammar = so_request.grammar if so_request is not None else None
            drafts = scheduled_spec_decode_tokens.get(request_id, ())
            if grammar is None:
                row += 1 + len(drafts)
                continue
            # Drafts past the first one the grammar rejects get the state
            # after the valid prefix (they are rejected by sampling anyway).
            valid_drafts = grammar.validate_tokens(drafts) if drafts else []
            for position in range(len(drafts) + 1):
                if not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row)
                row += 1
                if position < len(valid_drafts):
                    grammar.accept_tokens(request_id, [valid_drafts[position]])
            grammar.rollback(len(valid_drafts))
        return bitmask

    # ------------------------------------------------------------- stats

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for backend in self._backends.values():
            backend.close()
