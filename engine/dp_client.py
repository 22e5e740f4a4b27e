"""Data-parallel engines behind one front end: `parallel.data_parallel_size`
engine-core processes (replicas), each with its own executor and
tensor-parallel group; a routing policy (plugin kind `router`) picks the
replica of every request (engine/dp_router.py decides, these clients move
the messages).

`DPAsyncMPClient` speaks AsyncMPClient's interface to AsyncLLM (the
server); `SyncDPClient` speaks EngineCoreClient's to LLM. Each request (all
its samples) goes to the replica the policy picks, its aborts to that
replica, utility calls to every live replica; every replica's outputs are
read. A replica that dies is dropped from routing the moment it is seen
dead (the output reader watches every engine-core process's sentinel beside
the sockets, so a death is seen whatever the other replicas send; a send to
it, /health and every read look too): AsyncLLM fails the requests it held
that had output already (`ReplicaFailure`), those that had none yet and
those on their way there go to another, and the others keep serving; only
when every replica is dead is the engine dead. (LLM, offline, fails on the
first replica that dies.)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from pagedllm.core.errors import EngineDeadError
from pagedllm.engine.core_client import (
    DEFAULT_STARTUP_TIMEOUT_S,
    LIVENESS_POLL_S,
    AsyncMPClient,
    EngineCoreClient,
    SyncMPClient,
)
from pagedllm.engine.dp_router import ReplicaFailure, ReplicaRouter, replica_configs
from pagedllm.engine.wire import EngineCoreOutputs

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.engine.wire import EngineCoreRequest, Ready

logger = logging.getLogger(__name__)


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig, *, in_thread: bool = False) -> None:
        self.router = ReplicaRouter(config)
        self.clients: list[AsyncMPClient] = []
        self._turn = itertools.count()  # whose output is read first (fairness)
        # Replicas found dead outside the reader (a send, /health): the reader hands these out first.
        self._failures: collections.deque[ReplicaFailure] = collections.deque()
        # Engine request id -> its request's engine requests, until any of them has output.
        self._unstarted: dict[str, list[EngineCoreRequest]] = {}
        # Replica -> (sent at, its health ping in flight): one at a time each.
        self._pings: dict[int, tuple[float, asyncio.Task[Any]]] = {}
        self.health_timeout_s = config.server.health_timeout_s
        try:
            for replica_config in replica_configs(config, self.router.mirrors_caches):
                self.clients.append(AsyncMPClient(replica_config, in_thread=in_thread))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------ lifecycle

    def wait_for_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> Ready:
        """Every replica's Ready (they load at once); the first one's figures."""
        deadline = time.monotonic() + timeout_s
        try:
            readies = [client.wait_for_ready(max(deadline - time.monotonic(), 1.0)) for client in self.clients]
        except BaseException:
            self.shutdown()
            raise
        self.ready = readies[0]
        return self.ready

    @property
    def engine_pid(self) -> int | None:
        return self.clients[0].engine_pid

    @property
    def engine_pids(self) -> list[int | None]:
        return [client.engine_pid for client in self.clients]

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()

    # ------------------------------------------------------------- liveness

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.router.dead_error

    @dead_error.setter
    def dead_error(self, error: EngineDeadError | None) -> None:
        self.router.dead_error = error

    def check_alive(self) -> None:
        """Look at every live replica now (a cheap check of its process);
        one found dead leaves routing at once and its requests' failure waits
        for the output reader. EngineDeadError once none is alive."""
        for book in self.router.live():
            if not book.alive:  # found dead meanwhile (a request moved off another one)
                continue
            try:
                self.clients[book.index].check_alive()
            except EngineDeadError as exc:
                self._replica_died(book.index, exc)
        self.router.check_alive()

    def _replica_died(self, replica: int, error: EngineDeadError) -> None:
        """`replica` is dead: out of routing; the requests it held that had
        no output yet go to another replica (nothing reached their clients),
        the others' failure waits for the reader. EngineDeadError once none
        is alive."""
        if not self.router.books[replica].alive:  # seen twice (a nested send found it too)
            self.router.check_alive()
            return
        failure = self.router.died(replica, error)
        retried = {id(group): group for request_id in failure.request_ids
                   if (group := self._unstarted.get(request_id)) is not None}
        for group in retried.values():
            self._place(group)
        moved = {request.request_id for group in retried.values() for request in group}
        if moved:
            logger.warning("%s: %d request(s) it held had no output yet; sent to another replica",
                           error, len(retried))
        failed = [request_id for request_id in failure.request_ids if request_id not in moved]
        if failed:
            self._failures.append(ReplicaFailure(replica, failed, error))

    @property
    def errored(self) -> bool:
        try:
            self.check_alive()
        except EngineDeadError:
            return True
        return False

    @property
    def last_heard_at(self) -> float:
        return max((self.clients[book.index].last_heard_at for book in self.router.live()), default=0.0)

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        return self.router.scheduler_stats

    # ---------------------------------------------------------------- input

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """One request's engine requests (its samples) to the replica the
        policy picks. They are kept until one of them has output: should
        that replica die first, they go to another instead of failing."""
        for request in requests:
            self._unstarted[request.request_id] = requests
        try:
            self._place(requests)
        except BaseException:
            self._forget_unstarted([request.request_id for request in requests])
            raise

    def _place(self, requests: list[EngineCoreRequest]) -> None:
        while True:
            replica = self.router.route(requests)  # EngineDeadError once none is alive
            try:
                self.clients[replica].add_requests(requests)
                return
            except EngineDeadError as exc:
                # Died since it was last looked at: out of routing, and on to another.
                self.router.unroute(replica, [request.request_id for request in requests])
                self._replica_died(replica, exc)

    def _forget_unstarted(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for request in self._unstarted.pop(request_id, ()):
                self._unstarted.pop(request.request_id, None)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._forget_unstarted(request_ids)
        for replica, mine in self.router.abort(request_ids).items():
            self.clients[replica].abort_requests(mine)

    # --------------------------------------------------------------- output

    async def get_output_async(
        self, timeout_s: float = LIVENESS_POLL_S
    ) -> EngineCoreOutputs | ReplicaFailure | None:
        """The next outputs of any replica, a replica's failure, or None when
        nothing came within `timeout_s` (EngineDeadError once none is alive).

        NOTE: each replica's death is seen whatever the others send: the
        poll also watches every engine-core process's sentinel (readable the
        moment it exits), and every call looks at every replica first."""
        if self._failed():
            return self._failures.popleft()
        live = [book.index for book in self.router.live()]
        poller = zmq.asyncio.Poller()
        for replica in live:
            client = self.clients[replica]
            poller.register(client.output_socket_for_loop(), zmq.POLLIN)
            if client.sentinel is not None:
                poller.register(client.sentinel, zmq.POLLIN)
        ready = {socket for socket, _ in await poller.poll(int(timeout_s * 1000))}
        if self._failed():  # first: a dead replica's requests with no output must not get any now
            return self._failures.popleft()
        start = next(self._turn) % len(live)
        for replica in live[start:] + live[:start]:
            client = self.clients[replica]
            if client.output_socket_for_loop() not in ready or not self.router.books[replica].alive:
                continue
            try:
                message = await client.get_output_async(0.0)
            except EngineDeadError as exc:  # an EngineDead notice
                self._replica_died(replica, exc)
                return self._failures.popleft() if self._failures else None
            if message is not None:
                if self._unstarted:
                    self._forget_unstarted([output.request_id for output in message.outputs])
                return self.router.observe(replica, message)
        return None

    def _failed(self) -> bool:
        """Whether a replica's failure waits to be handed out (every replica looked at first)."""
        if not self._failures:
            self.check_alive()
        return bool(self._failures)

    # ------------------------------------------------------------ utilities

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        """Run a utility on every live replica; reset_prefix_cache: whether
        every replica reset, else the first replica's answer (of those that
        answered: one that dies meanwhile leaves it to the others). A ping
        answers with the first replica's pong: a stopped or wedged one must
        not hold /health back (replica_health names it)."""
        if name == "ping":
            return await self._ping_any()
        results = await asyncio.gather(
            *(self.clients[book.index].call_utility_async(name, *args) for book in self.router.live()),
            return_exceptions=True,
        )
        for result in results:  # NOTE: a replica that died meanwhile is no answer, not an error
            if isinstance(result, BaseException) and not isinstance(result, EngineDeadError):
                raise result
        answers = [result for result in results if not isinstance(result, BaseException)]
        if not answers:
            self.check_alive()  # EngineDeadError once none is alive
        if name == "reset_prefix_cache":
            return all(answers)
        return answers[0] if answers else None

    async def _ping_any(self) -> Any:
        pending = {self._replica_ping(book.index) for book in self.router.live()}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for ping in done:
                if not ping.cancelled() and ping.exception() is None:
                    return ping.result()
        self.check_alive()  # EngineDeadError once none is alive
        return None

    def _replica_ping(self, replica: int) -> asyncio.Task[Any]:
        """The replica's health ping in flight, sent now if none is."""
        in_flight = self._pings.get(replica)
        if in_flight is None or in_flight[1].done():
            task = asyncio.ensure_future(self.clients[replica].call_utility_async("ping"))
            in_flight = self._pings[replica] = (time.monotonic(), task)
        return in_flight[1]

    def replica_health(self) -> list[dict[str, Any]]:
        """Each replica: alive (or the error it died of) and, when alive,
        responsive: heard from within server.health_timeout_s, or its ping
        not yet that old (one is sent to a replica not heard from)."""
        now = time.monotonic()
        rows = self.router.health()
        for row in rows:
            if row["alive"]:
                row["responsive"] = self._responsive(row["replica"], now)
        return rows

    def _responsive(self, replica: int, now: float) -> bool:
        if now - self.clients[replica].last_heard_at < self.health_timeout_s:
            return True
        self._replica_ping(replica)
        sent_at, _ = self._pings[replica]
        return now - sent_at < self.health_timeout_s


class SyncDPClient(EngineCoreClient):
    """LLM's client over data-parallel replicas, each a SyncMPClient."""

    def __init__(self, config: EngineConfig) -> None:
        self.router = ReplicaRouter(config)
        self.clients: list[SyncMPClient] = []
        try:
            for replica_config in replica_configs(config, self.router.mirrors_caches):
                self.clients.append(SyncMPClient(replica_config))
        except BaseException:
            self.shutdown()
            raise
        self.ready = self.clients[0].ready
        self._poller = zmq.Poller()
        for client in self.clients:
            self._poller.register(client.output_socket, zmq.POLLIN)
        self._turn = itertools.count()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.clients[self.router.route(requests)].add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        for replica, mine in self.router.abort(request_ids).items():
            self.clients[replica].abort_requests(mine)

    def get_output(self) -> list[EngineCoreOutput]:
        """The next outputs of a replica that has requests (empty when none has)."""
        return self.next_outputs().outputs

    def next_outputs(self) -> EngineCoreOutputs:
        busy = [book.index for book in self.router.books if book.in_flight]
        if not busy:
            return EngineCoreOutputs([], None, 0, time.time())
        while True:
            ready = dict(self._poller.poll(int(LIVENESS_POLL_S * 1000)))
            start = next(self._turn) % len(busy)
            for replica in busy[start:] + busy[:start]:
                client = self.clients[replica]
                if client.output_socket in ready or client.has_pending_outputs:
                    return self.router.observe(replica, client.next_outputs())
                client.check_alive()

    def get_stats(self) -> SchedulerStats | None:
        """The live replicas' stats now, merged (their prefix-cache counts summed)."""
        replies = [(book.index, self.clients[book.index].get_stats()) for book in self.router.live()]
        return self.router.merge_stats({index: stats for index, stats in replies if stats is not None})

    def reset_prefix_cache(self) -> bool:
        return all([client.reset_prefix_cache() for client in self.clients])

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


__all__ = ["DPAsyncMPClient", "ReplicaFailure", "SyncDPClient"]
