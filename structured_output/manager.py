"""StructuredOutputManager: compiles grammars off the engine loop and builds
each step's bitmask.

    add_request -> grammar_init(request)   # submit (or hit the LRU cache)
    schedule()  -> is_ready(request)       # WAITING_FOR_FSM until compiled;
                                           # the rest of the batch runs meanwhile
                -> grammar_bitmask(...)    # one row per sampled position
    update_from_output -> accept_tokens    # advance with the accepted tokens

With a reasoning parser (structured_output.reasoning_parser) a request's
grammar waits for its reasoning section to end (structured_output.reasoning):
no bitmask rows and no grammar advance for the tokens sampled before that.

A compiled grammar is cached once per (backend, kind, spec, whitespace),
as a never-advanced Grammar that every request forks; in-flight compiles are
shared too, so a burst of identical schemas compiles once.

Limits: a spec past a size or depth limit fails its request without
compiling (structured_output.limits); a compile running longer than
`structured_output.compile_timeout_s` fails every request waiting on it, and
the compile pool is replaced so the grammars queued behind it still compile.
The API side has already compiled the same spec within that limit in a child
process (structured_output.validator), so this is the rare case (a loaded
machine, or a request that skipped the API: a crafted engine message).

A spec arrives with the API side's compile of it
(Request.compiled_grammar, the backend's `serialize`): the core loads it
(`deserialize`, about a millisecond for xgrammar) instead of compiling the
spec a second time; a spec the API side refused never reaches the core.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import InvalidRequestError, PagedLLMError
from pagedllm.structured_output.bitmask import allocate_token_bitmask
from pagedllm.structured_output.compile_job import CompileJob, CompilePool, GrammarKey
from pagedllm.structured_output.interface import Grammar, GrammarBackend, StructuredOutputKind
from pagedllm.structured_output.limits import check_spec_limits, summary
from pagedllm.structured_output.reasoning import ReasoningGate
from pagedllm.structured_output.validator import GrammarCheck, GrammarVocab, get_validator
from pagedllm.structured_output.whitespace import WhitespaceOptions, backend_kwargs, resolve_whitespace

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.core.request import Request
    from pagedllm.core.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class StructuredOutputRequest:
    """A request's grammar: compiling (job), ready (grammar) or failed (error);
    what the scheduler reads of it is core.request.StructuredOutputRequest."""

    key: GrammarKey
    job: CompileJob | None
    grammar: Grammar | None = None
    error: str | None = None
    # False while the request is still reasoning: its grammar waits.
    reasoning_ended: bool = True

    @property
    def future(self) -> Future[Grammar]:
        assert self.job is not None, "a request refused before compiling has no future"
        return self.job.future

    def is_ready(self) -> bool:
        """True once compiled or failed; forks the cached Grammar on first success."""
        if self.grammar is not None or self.error is not None:
            return True
        assert self.job is not None
        future = self.job.future
        if not future.done():
            if self.job.check_deadline():
                self.error = self._failed(
                    f"the compile took longer than structured_output.compile_timeout_s = {self.job.timeout_s:g} s"
                )
                return True
            return False
        exc = future.exception()
        if exc is not None:
            self.error = self._failed(str(exc) if isinstance(exc, PagedLLMError) else f"{type(exc).__name__}: {exc}")
            return True
        self.grammar = future.result().fork()
        return True

    def _failed(self, reason: str) -> str:
        return f"structured output ({self.key.backend}, {self.key.kind.value}) failed to compile: {reason}"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    # Misses served by loading the API side's compiled grammar (not compiled here).
    loaded: int = 0
    compile_seconds: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def backend_class(name: str) -> type[GrammarBackend]:
    """The registered GrammarBackend class `name` (InvalidRequestError if none)."""
    from pagedllm.plugins import get_plugin_manager

    registry = get_plugin_manager().grammar_backends
    if name not in registry:
        raise InvalidRequestError(
            "structured_outputs.backend", name, "registered grammar backends: " + ", ".join(sorted(registry.names()))
        )
    return registry.load(name)  # the registry checks the GrammarBackend base


def grammar_check(
    params: StructuredOutputsParams, config: StructuredOutputConfig, vocab: GrammarVocab | None = None
) -> GrammarCheck:
    """The cheap part of the API-side check (size and depth limits, the
    backend exists and takes this kind) and what the validator lane then
    runs. Raises InvalidRequestError; CPU work on a large spec (canonical
    JSON, its hash): keep it off the event loop."""
    check_spec_limits(params, config)  # NOTE: first: grammar_spec() below is recursive
    kind, spec = params.grammar_spec()
    backend_name = params.backend or config.backend
    backend_cls = backend_class(backend_name)
    if kind not in backend_cls.supported_kinds:
        raise InvalidRequestError(
            f"structured_outputs.{kind.value}", summary(spec),
            f"the {backend_name} backend does not support {kind.value}; it supports "
            + ", ".join(sorted(k.value for k in backend_cls.supported_kinds)),
        )
    return GrammarCheck.of(backend_cls, kind, spec, resolve_whitespace(params, config), config, vocab)


def validate_structured_outputs(
    params: StructuredOutputsParams, config: StructuredOutputConfig, vocab: GrammarVocab | None = None
) -> bytes | None:
    """The API-side check before scheduling: `grammar_check`, then the spec
    validates (and, given the model's `vocab`, compiles) within
    structured_output.compile_timeout_s in the validator lane. Blocking and
    thread-safe; returns the compiled grammar for the engine core, or None.
    (The server awaits the lane instead: `get_validator().submit`.)"""
    check = grammar_check(params, config, vocab)
    return get_validator(config.validator_processes).validate(check)


class StructuredOutputManager:
    def __init__(
        self,
        config: StructuredOutputConfig,
        *,
        vocab_size: int,
        tokenizer: str | Any,
        eos_token_id: int | None,
        max_num_rows: int,
        trust_remote_code: bool = False,
    ) -> None:
        """`tokenizer`: a loaded HF tokenizer or the folder to load it from,
        lazily, when the first backend is built (the core needs it only for
        structured output); its own code only with `trust_remote_code`."""
        self.trust_remote_code = trust_remote_code
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = tokenizer
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._cache: OrderedDict[GrammarKey, CompileJob] = OrderedDict()
        # Jobs not yet finished; the done callbacks (compile threads) remove them.
        self._pending: set[CompileJob] = set()
        self._pending_lock = threading.Lock()
        self.stats = CacheStats()
        # Reused every step; grows when a step needs more rows (drafts).
        self._bitmask = allocate_token_bitmask(max_num_rows, vocab_size)
        self.reasoning = ReasoningGate(config.reasoning_parser, self._locked_tokenizer)
        if config.reasoning_parser is not None:
            # Now, at start-up: not on the engine loop when the first request comes.
            _ = self.reasoning.parser

    # ------------------------------------------------------------- compile

    def grammar_init(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        backend_name = params.backend or self.config.backend
        try:
            check_spec_limits(params, self.config)
        except InvalidRequestError as exc:
            # Refused without compiling; the scheduler ends it like a failed compile.
            key = GrammarKey(backend_name, StructuredOutputKind(params.kind_name), "", True)
            request.structured_output_request = StructuredOutputRequest(
                key, None, error=f"structured output ({backend_name}, {key.kind.value}) refused: {exc}"
            )
            return
        kind, spec = params.grammar_spec()
        key = GrammarKey(backend_name, kind, spec, *resolve_whitespace(params, self.config))
        job = self._cache.get(key)
        if job is not None and not (job.future.done() and job.future.exception() is not None):
            self._cache.move_to_end(key)
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            job = CompileJob(key, self.config.compile_timeout_s, self._on_compile_timeout, request.compiled_grammar)
            with self._pending_lock:
                self._pending.add(job)
            job.future.add_done_callback(functools.partial(self._discard_pending, job))
            self._submit(job)
            if self.config.cache_size > 0:
                self._cache[key] = job
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        request.compiled_grammar = None  # the job holds it, or the cache had the grammar
        request.structured_output_request = StructuredOutputRequest(key, job)
        request.structured_output_request.reasoning_ended = self.reasoning.ended_in_prompt(request)

    def _submit(self, job: CompileJob) -> None:
        if self._pool is None:
            self._pool = CompilePool(self.config.num_compile_threads, self._run_job)
        self._pool.submit(job)

    def _run_job(self, job: CompileJob) -> None:
        if not job.claim():
            return  # resubmitted to a new pool, and started there
        try:
            grammar = self._load(job) or self._compile(job.key)
        except BaseException as exc:  # the request reports it
            job.future.set_exception(exc)
        else:
            job.future.set_result(grammar)

    def _on_compile_timeout(self, job: CompileJob) -> None:
        """A compile ran past the limit: its thread cannot be stopped, so the
        grammars queued behind it move to a fresh pool."""
        logger.warning(
            "grammar compile (%s, %s, %d bytes) ran past structured_output.compile_timeout_s = %g s; "
            "its requests fail", job.key.backend, job.key.kind.value, len(job.key.spec), job.timeout_s,
        )
        old, self._pool = self._pool, None
        if old is not None:
            old.shutdown()
        with self._pending_lock:
            queued = [pending for pending in self._pending if pending.started_at is None]
        for pending in queued:
            self._submit(pending)

    def _discard_pending(self, job: CompileJob, _future: Future[Grammar]) -> None:
        """The done callback of `job`'s future."""
        with self._pending_lock:
            self._pending.discard(job)

    def _load(self, job: CompileJob) -> Grammar | None:
        """The API side's compiled grammar for the job's spec, or None (none
        came, or the backend cannot load it: then it compiles)."""
        data, job.compiled = job.compiled, None
        if data is None:
            return None
        backend = self._get_backend(job.key.backend)
        try:
            grammar = backend.deserialize(job.key.kind, job.key.spec, data)
        except Exception as exc:  # a backend without it, or another tokenizer's grammar
            logger.warning("cannot load the API side's compiled %s grammar (%s); compiling it",
                           job.key.kind.value, exc)
            return None
        self.stats.loaded += 1
        return grammar

    def _compile(self, key: GrammarKey) -> Grammar:
        backend = self._get_backend(key.backend)
        start = time.perf_counter()
        whitespace = WhitespaceOptions(key.any_whitespace, key.max_whitespace)
        grammar = backend.compile(key.kind, key.spec, **backend_kwargs(backend.compile, whitespace))
        self.stats.compile_seconds.append(time.perf_counter() - start)
        return grammar

    def _get_backend(self, name: str) -> GrammarBackend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = backend_class(name)(self.tokenizer, self.vocab_size, self.eos_token_id, self.config)
                self._backends[name] = backend
            return backend

    def _locked_tokenizer(self) -> Any:
        with self._lock:  # a compile thread may be loading it
            return self.tokenizer

    @property
    def tokenizer(self) -> Any:
        # NOTE: called under self._lock (first backend build), on a compile thread.
        if isinstance(self._tokenizer, str):
            from pagedllm.model_registry.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer, self.trust_remote_code)
        return self._tokenizer

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until any compile finishes or `timeout_s` passes (an idle
        engine must not spin while it waits for grammars)."""
        with self._pending_lock:
            pending = [job.future for job in self._pending]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------- reasoning

    def is_reasoning_ended(self, request: Request) -> bool:
        so_request = request.structured_output_request
        return not isinstance(so_request, StructuredOutputRequest) or so_request.reasoning_ended

    def grammar_token_ids(self, request: Request, new_token_ids: Sequence[int]) -> Sequence[int]:
        """Of the tokens just appended to `request`, those its grammar
        advances on: all of them once its reasoning has ended; while it has
        not, only those after its end (none while it goes on)."""
        so_request = request.structured_output_request
        if not isinstance(so_request, StructuredOutputRequest) or so_request.reasoning_ended:
            return new_token_ids
        content_ids = self.reasoning.content_ids(request.output_token_ids)
        if content_ids is None:
            return ()
        so_request.reasoning_ended = True
        # NOTE: reasoning was not over before this step, so every content token is a new one.
        return content_ids[max(0, len(content_ids) - len(new_token_ids)) :]

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
            drafts: Sequence[int] = scheduled_spec_decode_tokens.get(request_id, ())
            if grammar is None:
                row += 1 + len(drafts)
                continue
            if not self.is_reasoning_ended(requests[request_id]):
                # Rows sampled while reasoning stay all-allowed; a draft may
                # end it, and the rows after that follow the grammar.
                num_free_rows = self.reasoning.num_free_rows(requests[request_id].output_token_ids, drafts)
                row += num_free_rows
                if num_free_rows > len(drafts):
                    continue
                drafts = drafts[num_free_rows:]
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
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for backend in self._backends.values():
            backend.close()
