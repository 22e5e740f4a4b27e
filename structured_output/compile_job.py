"""CompileJob: one grammar compile in the engine core, shared by every
request with its key, and the deadline it runs under.

A compile thread cannot be stopped, so a job past
`structured_output.compile_timeout_s` is reported to the manager once (it
fails the waiting requests and moves the queued jobs to a fresh pool), and
the thread finishes on its own. A job that completes after all is used by
later requests as any cached grammar.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pagedllm.structured_output.interface import Grammar, StructuredOutputKind


class GrammarKey(NamedTuple):
    """What a compile depends on: requests with equal keys share one job."""

    backend: str
    kind: StructuredOutputKind
    spec: str
    any_whitespace: bool
    # The longest JSON whitespace run; None = unbounded (see whitespace.py).
    max_whitespace: int | None = None


class CompileJob:
    """One compile (shared by every request with its key): its future, when a
    compile thread started it, and the limit it runs under."""

    def __init__(
        self, key: GrammarKey, timeout_s: float, on_timeout: Callable[[CompileJob], None],
        compiled: bytes | None = None,
    ) -> None:
        self.key = key
        # The API side's compiled grammar for this key (loaded, not compiled), if any.
        self.compiled = compiled
        self.timeout_s = timeout_s
        self.future: Future[Grammar] = Future()
        self.started_at: float | None = None
        self.timed_out = False
        self._on_timeout = on_timeout
        self._claim_lock = threading.Lock()

    def claim(self) -> bool:
        """Called by the compile thread: True for the one that may run it."""
        with self._claim_lock:
            if self.started_at is not None:
                return False
            self.started_at = time.monotonic()
            return True

    def check_deadline(self) -> bool:
        """True if the compile has run past its limit (reported once to the manager)."""
        if (
            not self.timed_out
            and self.started_at is not None
            and not self.future.done()
            and time.monotonic() - self.started_at > self.timeout_s
        ):
            self.timed_out = True
            self._on_timeout(self)
        return self.timed_out and not self.future.done()


class CompilePool:
    """Daemon threads running compile jobs in submission order.

    NOTE: not a ThreadPoolExecutor: its threads are joined at interpreter
    exit, so one compile past its deadline (it cannot be interrupted) would
    hold up the engine core's exit until it finished. A daemon thread ends
    with the process.
    """

    def __init__(self, num_threads: int, run: Callable[[CompileJob], None], name: str = "pagedllm-grammar") -> None:
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._run = run
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True) for index in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: CompileJob) -> None:
        self._queue.put(job)

    def shutdown(self) -> None:
        """Threads exit once their current job ends; jobs still queued are dropped."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._queue.put(None)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            self._run(job)
