"""GrammarValidator: the API process's lane for grammar checks. Each spec is
validated and, when the model's vocabulary is known (GrammarVocab),
compiled exactly as the engine core will, in a child process that is killed
past `structured_output.compile_timeout_s` (validator_child.py).

Parsing alone is no proxy for the core's cost: measured with xgrammar 0.2.9
on this machine, the regex `(a|b|c|d|e|f|g|h)` x 2000 parses in 0.045 s but
compiles in 2.9 s against an 8k vocabulary. So "passed within the limit"
bounds the core's compile only with a vocab; without one it bounds the parse.

The lane, so that one client's costly specs cannot hold up anyone else:

- Its own threads: `validator_processes` runner threads, each owning one
  child. All children start (and load the backend and vocabulary) with the
  first spec, and a child killed at the time limit restarts before its
  runner takes the next spec, so a cheap spec does not wait for a cold
  start. A caller never holds a thread while it waits: `submit` returns a
  future (the server awaits it on its event loop; `validate` blocks, for
  the offline `LLM`).
- Results are cached by key (backend, kind, spec hash, whitespace, vocab,
  config): a repeated spec never reaches a child again, and a burst of one
  spec runs once (the callers share the job).
- Two queues. A spec is *costly* if compile_cost.presumed_costly says so,
  if its key ran past `cheap_compile_s` before (remembered), or once it runs
  past `cheap_compile_s` now; every other spec is cheap. Cheap specs go
  first, to any idle child; costly ones run on at most all children but one
  (the one left is for cheap specs) and at most
  `max_costly_compiles_per_client` at a time per client (a costly spec
  holds its place until its child has restarted). A cheap spec that turns
  out costly while those are full is taken back (its child killed and
  replaced) and queued as costly, first in its client's queue.
- Per client (the caller's name for it: the server uses the client's
  address), costly specs wait in the client's own queue; the client served
  least recently goes first; past `max_queued_compiles_per_client` waiting,
  the request is refused with CompileQueueFullError (HTTP 429).
- The result of a compile, serialized by the backend (`serialize`), is
  returned with the outcome, so the engine core loads it instead of
  compiling the spec again (engine.wire.EngineCoreRequest.compiled_grammar).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from pagedllm.core.errors import InvalidRequestError, PagedLLMError
from pagedllm.structured_output.compile_cost import presumed_costly
from pagedllm.structured_output.validator_child import ChildReply, Refusal, ValidatorChild

if TYPE_CHECKING:
    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.structured_output.interface import GrammarBackend, StructuredOutputKind
    from pagedllm.structured_output.whitespace import WhitespaceOptions

logger = logging.getLogger(__name__)

# Children when the caller names no number (structured_output.validator_processes).
DEFAULT_MAX_CHILDREN = 2
# Validation results kept (passed or refused), least recently used dropped,
# and the bytes of compiled grammars among them.
RESULT_CACHE_SIZE = 1024
RESULT_CACHE_BYTES = 64 << 20
# Keys remembered as costly (ran past cheap_compile_s).
COSTLY_KEYS_SIZE = 4096
# Clients whose last turn is remembered (one forgotten is served as new).
LAST_SERVED_SIZE = 65536
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


class CompileQueueFullError(PagedLLMError):
    """A client already has `limit` costly grammar compiles waiting (HTTP 429)."""

    def __init__(self, client: str, field: str, limit: int) -> None:
        self.client = client
        self.field = field
        self.limit = limit
        super().__init__(
            f"{field}: this client ({client or 'local'}) already has {limit} costly grammar compiles waiting; "
            f"the limit is structured_output.max_queued_compiles_per_client = {limit}; retry later"
        )


@dataclass(frozen=True)
class GrammarCheck:
    """One spec to check, as the lane runs it; build with `GrammarCheck.of`."""

    backend_cls: type[GrammarBackend]
    kind: StructuredOutputKind
    spec: str
    whitespace: WhitespaceOptions
    config: StructuredOutputConfig
    vocab: GrammarVocab | None
    key: tuple[Any, ...]

    @classmethod
    def of(
        cls, backend_cls: type[GrammarBackend], kind: StructuredOutputKind, spec: str, whitespace: WhitespaceOptions,
        config: StructuredOutputConfig, vocab: GrammarVocab | None = None,
    ) -> GrammarCheck:
        key = (_class_path(backend_cls), kind.value, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).digest(),
               tuple(whitespace), vocab, config.model_dump_json())
        return cls(backend_cls, kind, spec, whitespace, config, vocab, key)

    @property
    def field(self) -> str:
        return f"structured_outputs.{self.kind.value}"

    def child_request(self) -> dict[str, Any]:
        return {"backend": _class_path(self.backend_cls), "config": self.config.model_dump_json(),
                "vocab": self.vocab, "kind": self.kind.value, "spec": self.spec, "whitespace": list(self.whitespace)}


class GrammarOutcome(NamedTuple):
    """A check's result: refused (or None), and the compiled grammar to hand
    to the engine core (bytes from the backend's `serialize`, or None)."""

    refusal: Refusal | None
    compiled: bytes | None = None

    def raise_refusal(self) -> bytes | None:
        """InvalidRequestError if refused, else the compiled grammar."""
        if self.refusal is not None:
            raise InvalidRequestError(self.refusal.field, self.refusal.value, self.refusal.limit)
        return self.compiled


@dataclass(eq=False)
class _Job:
    check: GrammarCheck
    client: str
    costly: bool
    waiters: list[Future[GrammarOutcome]] = field(default_factory=list)
    runner: _Runner | None = None


class GrammarValidator:
    """The lane (module doc): its runners, queues and results, thread-safe."""

    def __init__(self, max_children: int = DEFAULT_MAX_CHILDREN) -> None:
        self._lock = threading.Lock()
        self._runners = [_Runner(self, index) for index in range(max(1, max_children))]
        # Idle runners, the most recently released last.
        self._idle: list[_Runner] = list(reversed(self._runners))
        self._cheap: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._costly: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._jobs: dict[tuple[Any, ...], _Job] = {}  # queued or running, by key
        # client -> when it was last served (a turn number): the least recent goes first.
        self._last_served: OrderedDict[str, int] = OrderedDict()
        self._turn = 0
        self._costly_running: Counter[str] = Counter()
        self._costly_keys: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        # key -> (outcome, monotonic time it is forgotten)
        self._results: OrderedDict[tuple[Any, ...], tuple[GrammarOutcome, float]] = OrderedDict()
        self._result_bytes = 0
        self._closed = False
        self.num_compiles = 0  # specs sent to a child (for tests and logs)

    @property
    def pid(self) -> int | None:
        """The pid of the first runner's child."""
        return self._runners[0].child.pid

    @property
    def pids(self) -> list[int]:
        return [runner.child.pid for runner in self._runners if runner.child.pid is not None]

    def validate(self, check: GrammarCheck, client: str = "") -> bytes | None:
        """Blocking: InvalidRequestError if the spec does not validate (and
        compile, with a vocab) within compile_timeout_s; else the compiled
        grammar for the core (or None)."""
        return self.submit(check, client).result().raise_refusal()

    def submit(self, check: GrammarCheck, client: str = "") -> Future[GrammarOutcome]:
        """A future of the check's outcome; cancelling it gives up the wait
        (a job nobody waits for leaves its queue). CompileQueueFullError if
        `client` has too many costly specs waiting."""
        waiter: Future[GrammarOutcome] = Future()
        with self._lock:
            cached = self._cached_locked(check.key)
            if cached is not None:
                waiter.set_result(cached)
                return waiter
            job = self._jobs.get(check.key)
            if job is None:
                job = self._enqueue_locked(check, client)
            job.waiters.append(waiter)
            self._dispatch_locked()
        waiter.add_done_callback(lambda done: self._on_waiter_done(job, done))
        return waiter

    def _cached_locked(self, key: tuple[Any, ...]) -> GrammarOutcome | None:
        entry = self._results.get(key)
        if entry is None:
            return None
        if time.monotonic() >= entry[1]:
            self._drop_result_locked(key)
            return None
        self._results.move_to_end(key)
        return entry[0]

    def _enqueue_locked(self, check: GrammarCheck, client: str) -> _Job:
        costly = check.key in self._costly_keys or presumed_costly(check.spec)
        queues = self._costly if costly else self._cheap
        if costly:
            limit = check.config.max_queued_compiles_per_client
            if len(queues.get(client, ())) >= limit:
                raise CompileQueueFullError(client, check.field, limit)
        job = _Job(check, client, costly)
        queues.setdefault(client, deque()).append(job)
        self._jobs[check.key] = job
        return job

    def _dispatch_locked(self) -> None:
        """Idle runners take the next jobs: a cheap job the runner that served
        last (its child is warm), a costly one the runner idle longest. Then
        a runner whose child never started warms it for the same spec's
        backend, so a cheap spec finds a ready child while the others work."""
        check = None
        while self._idle and not self._closed:
            job = self._next_job_locked()
            if job is None:
                break
            runner = self._idle.pop(0 if job.costly else -1)
            job.runner, check = runner, job.check
            runner.assign(job)
        cold = [runner for runner in self._idle if runner.child.pid is None]
        if check is not None and cold and not self._closed:
            self._idle.remove(cold[0])
            cold[0].assign(check)

    def _next_job_locked(self) -> _Job | None:
        """The next cheap job (the client served least recently first), else
        the next costly one that the global and per-client limits allow."""
        if self._cheap:
            return self._pop_fair_locked(self._cheap, lambda client: True)
        if self._num_costly_running() >= self._max_costly():
            return None
        job = self._pop_fair_locked(self._costly, self._client_may_start_costly)
        if job is not None:
            self._costly_running[job.client] += 1
        return job

    def _pop_fair_locked(self, queues: OrderedDict[str, deque[_Job]], allowed: Callable[[str], bool]) -> _Job | None:
        """The first job of the client that `allowed` admits and that was
        served least recently (never served: first)."""
        clients = [client for client in queues if allowed(client)]
        if not clients:
            return None
        client = min(clients, key=lambda name: self._last_served.get(name, -1))
        queue = queues[client]
        job = queue.popleft()
        if not queue:
            del queues[client]
        self._turn += 1
        self._last_served[client] = self._turn
        self._last_served.move_to_end(client)
        while len(self._last_served) > LAST_SERVED_SIZE:
            self._last_served.popitem(last=False)
        return job

    def _client_may_start_costly(self, client: str) -> bool:
        queue = self._costly[client]
        return self._costly_running[client] < queue[0].check.config.max_costly_compiles_per_client

    def _max_costly(self) -> int:
        return max(1, len(self._runners) - 1)

    def _num_costly_running(self) -> int:
        return sum(self._costly_running.values())

    def on_checkpoint(self, job: _Job) -> bool:
        """A cheap job still runs after cheap_compile_s (a runner thread):
        it is costly now. True: it goes on, as costly; False: the costly
        limits are full, so it is taken back and queued as costly."""
        with self._lock:
            self._remember_costly_locked(job.check.key)
            limit = job.check.config.max_costly_compiles_per_client
            if self._num_costly_running() >= self._max_costly() or self._costly_running[job.client] >= limit:
                return False
            job.costly = True
            self._costly_running[job.client] += 1
            return True

    def finish(self, job: _Job, reply: ChildReply) -> None:
        """A runner is done with `job` (a runner thread); it comes back with
        `release`. NOTE: a costly job counts against the costly limits until
        then: the restart of a child killed at the time limit is its cost too."""
        with self._lock:
            runner, job.runner = job.runner, None
            if runner is not None and job.costly:
                runner.costly_client = job.client
            waiters: list[Future[GrammarOutcome]] = []
            outcome = GrammarOutcome(reply.refusal, reply.compiled)
            if not reply.preempted:
                self._record_locked(job, outcome)
                waiters, job.waiters = job.waiters, []
            elif job.waiters and not self._closed:  # first in its client's costly queue: it has waited already
                job.costly = True
                self._costly.setdefault(job.client, deque()).appendleft(job)
                self._costly_running[job.client] += 1  # its runner restarts the killed child: released below
                if runner is not None:
                    runner.costly_client = job.client
            else:
                del self._jobs[job.check.key]
                waiters, job.waiters = job.waiters, []
                outcome = _closing_outcome(job.check)
            self._dispatch_locked()  # another runner may take a job this one held back
        for waiter in waiters:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                waiter.set_result(outcome)

    def release(self, runner: _Runner) -> None:
        """`runner` is idle again, its child warm (a runner thread)."""
        with self._lock:
            client, runner.costly_client = runner.costly_client, None
            if client is not None:
                self._costly_running[client] -= 1
                if self._costly_running[client] <= 0:
                    del self._costly_running[client]
            self._idle.append(runner)
            self._dispatch_locked()

    def _record_locked(self, job: _Job, outcome: GrammarOutcome) -> None:
        self.num_compiles += 1
        del self._jobs[job.check.key]
        transient = outcome.refusal is not None and outcome.refusal.transient
        if transient:
            self._remember_costly_locked(job.check.key)
        forget_at = time.monotonic() + TRANSIENT_MEMORY_S if transient else float("inf")
        self._drop_result_locked(job.check.key)
        self._results[job.check.key] = (outcome, forget_at)
        self._result_bytes += len(outcome.compiled or b"")
        while self._results and (len(self._results) > RESULT_CACHE_SIZE or self._result_bytes > RESULT_CACHE_BYTES):
            self._drop_result_locked(next(iter(self._results)))

    def _drop_result_locked(self, key: tuple[Any, ...]) -> None:
        entry = self._results.pop(key, None)
        if entry is not None:
            self._result_bytes -= len(entry[0].compiled or b"")

    def _remember_costly_locked(self, key: tuple[Any, ...]) -> None:
        self._costly_keys[key] = None
        self._costly_keys.move_to_end(key)
        while len(self._costly_keys) > COSTLY_KEYS_SIZE:
            self._costly_keys.popitem(last=False)

    def _on_waiter_done(self, job: _Job, waiter: Future[GrammarOutcome]) -> None:
        """A waiter gave up (cancelled): a queued job nobody waits for leaves its queue."""
        if not waiter.cancelled():
            return
        with self._lock:
            with contextlib.suppress(ValueError):
                job.waiters.remove(waiter)
            if job.waiters or job.runner is not None or self._jobs.get(job.check.key) is not job:
                return
            del self._jobs[job.check.key]
            queues = self._costly if job.costly else self._cheap
            queue = queues.get(job.client)
            if queue is not None:
                with contextlib.suppress(ValueError):
                    queue.remove(job)
                if not queue:
                    del queues[job.client]

    def close(self) -> None:
        """Stop the children; whoever still waits gets a (transient) refusal."""
        with self._lock:
            self._closed = True
            queued = [job for queues in (self._cheap, self._costly) for queue in queues.values() for job in queue]
            self._cheap.clear()
            self._costly.clear()
            for job in queued:
                del self._jobs[job.check.key]
        for job in queued:
            for waiter in job.waiters:
                with contextlib.suppress(InvalidStateError):
                    waiter.set_result(_closing_outcome(job.check))
        for runner in self._runners:
            runner.close()


def _closing_outcome(check: GrammarCheck) -> GrammarOutcome:
    return GrammarOutcome(Refusal(check.field, "<spec>", "the grammar validator is shutting down", transient=True))


class _Runner:
    """One lane thread and its child: runs the jobs the lane assigns, one at a
    time, and warms its child (start, backend and vocab) when told to or
    after a kill, before it is idle again."""

    def __init__(self, lane: GrammarValidator, index: int) -> None:
        self.lane = lane
        self.child = ValidatorChild()
        # The client of the costly job it ran last, until it is released.
        self.costly_client: str | None = None
        self._assigned: deque[_Job | GrammarCheck] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"pagedllm-grammar-lane-{index}", daemon=True)
        self._thread.start()

    def assign(self, task: _Job | GrammarCheck) -> None:
        """A job to run, or a check whose backend the child is to get ready for."""
        with self._wake:
            self._assigned.append(task)
            self._wake.notify()

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._assigned and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                task = self._assigned.popleft()
            if isinstance(task, _Job):
                self.lane.finish(task, self._run(task))
                task = task.check
            # NOTE: after the waiters have their answer: a child killed at the
            # time limit restarts now, not when the next spec is waiting for it.
            self.child.warm(task.backend_cls, task.child_request())
            self.lane.release(self)

    def _run(self, job: _Job) -> ChildReply:
        check = job.check
        checkpoint_s = None if job.costly else check.config.cheap_compile_s
        try:
            return self.child.run(check.backend_cls, check.child_request(), check.config.compile_timeout_s,
                                  checkpoint_s, lambda: self.lane.on_checkpoint(job))
        except Exception as exc:  # a bug here must not leave its callers waiting forever
            logger.exception("grammar validation failed unexpectedly")
            return ChildReply(Refusal(check.field, "<spec>", f"the grammar validator failed ({exc})", transient=True))

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self.child.close()


def _class_path(backend_cls: type) -> str:
    return f"{backend_cls.__module__}:{backend_cls.__qualname__}"


_default: GrammarValidator | None = None
_default_lock = threading.Lock()


def get_validator(num_children: int | None = None) -> GrammarValidator:
    """This process's validator (its children start on first use); the first
    call's `num_children` (structured_output.validator_processes) sizes it."""
    global _default
    with _default_lock:
        if _default is None:
            _default = GrammarValidator(num_children or DEFAULT_MAX_CHILDREN)
            atexit.register(shutdown_validator)
        return _default


def shutdown_validator() -> None:
    """Stop this process's validator children (at exit; a later call starts others)."""
    global _default
    with _default_lock:
        validator, _default = _default, None
    if validator is not None:
        validator.close()
