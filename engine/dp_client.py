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
(`ReplicaFailure`), a request on its way there goes to another, and the
others keep serving; only when every replica is dead is the engine dead. (LLM, offline, fails on the first
replica that dies.)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
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


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig, *, in_thread: bool = False) -> None:
        self.router = ReplicaRouter(config)
        self.clients: list[AsyncMPClient] = []
        self._turn = itertools.count()  # whose output is read first (fairness)
        # Replicas found dead outside the reader (a send, /health): the reader hands these out first.
        self._failures: collections.deque[ReplicaFailure] = collections.deque()
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
            try:
                self.clients[book.index].check_alive()
            except EngineDeadError as exc:
                self._failures.append(self.router.died(book.index, exc))
        self.router.check_alive()

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
        """One request's engine requests (its samples) to the replica the policy picks."""
        while True:
            replica = self.router.route(requests)  # EngineDeadError once none is alive
            try:
                self.clients[replica].add_requests(requests)
                return
            except EngineDeadError as exc:
                # Died since it was last looked at: out of routing, and on to another.
                self.router.unroute(replica, [request.request_id for request in requests])
                self._failures.append(self.router.died(replica, exc))

    def abort_requests(self, request_ids: list[str]) -> None:
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
        if not self._failures:
            self.check_alive()
        if self._failures:
            return self._failures.popleft()
        live = [book.index for book in self.router.live()]
        poller = zmq.asyncio.Poller()
        for replica in live:
            client = self.clients[replica]
            poller.register(client.output_socket_for_loop(), zmq.POLLIN)
            if client.sentinel is not None:
                poller.register(client.sentinel, zmq.POLLIN)
        ready = {socket for socket, _ in await poller.poll(int(timeout_s * 1000))}
        start = next(self._turn) % len(live)
        for replica in live[start:] + live[:start]:
            client = self.clients[replica]
            if client.output_socket_for_loop() not in ready:
                continue
            try:
                message = await client.get_output_async(0.0)
            except EngineDeadError as exc:  # an EngineDead notice
                return self.router.died(replica, exc)
            if message is not None:
                return self.router.observe(replica, message)
        return None

    # ------------------------------------------------------------ utilities

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        """Run a utility on every live replica; reset_prefix_cache: whether
        every replica reset, else the first replica's answer."""
        results = await asyncio.gather(
            *(self.clients[book.index].call_utility_async(name, *args) for book in self.router.live())
        )
        if name == "reset_prefix_cache":
            return all(results)
        return results[0] if results else None

    def replica_health(self) -> list[dict[str, Any]]:
        return self.router.health()


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
