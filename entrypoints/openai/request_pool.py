"""The API process's worker pool: the CPU-heavy parts of a request
(tokenizing, detokenizing, chat templates, request validation) run here, off
the event loop, so /health, /metrics and small requests keep
being answered while one client sends a maximal body (vLLM answered the same
problem with its async tokenizer pool).

Bounded by a semaphore in front of the threads rather than by the executor's
own queue: work reaches a thread only when one is free, so a flood waits as
suspended coroutines that a client disconnect simply cancels, the threads
never hold a backlog, and a slot stays taken until its thread has really
finished (a cancelled request cannot start more work than there are threads).

    pool = RequestWorkerPool(num_threads=4)
    token_ids = await pool.run(tokenizer.encode, text)

NOTE: a grammar's validation and compile never run here: they may take up to
structured_output.compile_timeout_s, so a few costly schemas would hold every
thread. The handlers await them in the validator lane (structured_output.validator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.memory import trim_process_memory

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A request whose body is at least this many bytes (its parsed copies and its
# tokenizer work are several times that) has freed memory handed back to the
# OS afterwards.
LARGE_REQUEST_SIZE = 1 << 20
# Seconds after such a request before trimming (its objects are gone by then),
# and the least time between two trims: malloc_trim walks the whole heap.
TRIM_DELAY_S = 0.5
MIN_TRIM_INTERVAL_S = 2.0


class RequestWorkerPool:
    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="pagedllm-request")
        # NOTE: made in (and for) the loop that serves requests, on first use.
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._num_waiting = 0
        self._trim_handle: asyncio.TimerHandle | None = None
        self._last_trim_at = float("-inf")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread, once one is free."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.num_threads), loop
        slots = self._slots
        self._num_waiting += 1
        try:
            await slots.acquire()
        finally:
            self._num_waiting -= 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            slots.release()
            raise
        future.add_done_callback(lambda _: _call_soon(loop, slots.release))
        # A cancelled caller (client gone) leaves the thread to finish; the
        # slot comes back when it does.
        return await asyncio.wrap_future(future)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a thread (for logs and tests)."""
        return self._num_waiting

    def note_request_size(self, size: int) -> None:
        """After a request whose body had `size` bytes: schedule one trim of
        freed memory if it was large (coalesced, rate-limited)."""
        if size < LARGE_REQUEST_SIZE or self._trim_handle is not None:
            return
        loop = asyncio.get_running_loop()
        delay_s = max(TRIM_DELAY_S, self._last_trim_at + MIN_TRIM_INTERVAL_S - loop.time())
        self._trim_handle = loop.call_later(delay_s, self._start_trim, loop)

    def _start_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        self._trim_handle = None
        self._last_trim_at = loop.time()
        # In a thread: trimming a 700 MB heap took 35 ms.
        try:
            future: Future[bool] = self._executor.submit(trim_process_memory)
        except RuntimeError:  # shut down meanwhile
            return
        future.add_done_callback(_log_trim_failure)

    def shutdown(self) -> None:
        if self._trim_handle is not None:
            self._trim_handle.cancel()
            self._trim_handle = None
        self._executor.shutdown(wait=False, cancel_futures=True)


# NOTE: keyed weakly by engine, so the handlers of one app share one pool
# and a pool lives as long as its engine.
_pools: weakref.WeakKeyDictionary[Any, RequestWorkerPool] = weakref.WeakKeyDictionary()


def shared_request_pool(engine: Any, num_threads: int) -> RequestWorkerPool:
    """The pool of `engine`'s API handlers, made on first use."""
    try:
        pool = _pools.get(engine)
        if pool is None:
            pool = _pools[engine] = RequestWorkerPool(num_threads)
    except TypeError:  # a stub engine that takes no weak reference: its own pool
        pool = RequestWorkerPool(num_threads)
    return pool


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    # The loop may be gone when a thread finishes after shutdown.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def _log_trim_failure(future: Future[bool]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("returning freed memory to the OS failed: %s", future.exception())
