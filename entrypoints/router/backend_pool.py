"""The backends behind a front door: whether each lives, its load, and what
its prefix caches hold (mirrored from its GET /v1/kv_events).

A health loop asks every backend's /health each `health_interval_s`: a
backend that fails it leaves routing, one that answers again comes back (its
cache mirror rebuilt from a snapshot). An events loop keeps each mirror
current between requests; after a request, the backend that served it is
asked at once, so the next decision sees what that request cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedllm.routers.cache_mirror import ReplicaCacheMirror

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
EVENTS_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 5.0


@dataclass
class Backend:
    index: int
    url: str
    alive: bool = False  # until its first healthy answer
    error: str | None = "not checked yet"
    in_flight: int = 0
    num_routed: int = 0
    mirror: ReplicaCacheMirror = field(default_factory=ReplicaCacheMirror)
    events_seq: int | None = None  # None: the next read is a snapshot
    events_on: bool = True  # False: the backend serves no KV events (not started with --enable-kv-events)
    # How its blocks are hashed (from its KV events).
    block_size: int | None = None
    hash_algo: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.url, "alive": self.alive, **({"error": self.error} if self.error else {})}


class BackendPool:
    def __init__(self, urls: list[str], *, api_key: str | None = None, timeout_s: float = 600.0,
                 health_interval_s: float = HEALTH_INTERVAL_S, events_interval_s: float = EVENTS_INTERVAL_S) -> None:
        self.backends = [Backend(index, url.rstrip("/")) for index, url in enumerate(urls)]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=timeout_s)
        self.health_interval_s = health_interval_s
        self.events_interval_s = events_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        # Called with a backend's index when it leaves routing (metrics).
        self.on_health_change: Any = None

    def live(self) -> list[Backend]:
        return [backend for backend in self.backends if backend.alive]

    async def start(self) -> None:
        await asyncio.gather(*(self.check_health(backend) for backend in self.backends))
        await asyncio.gather(*(self.refresh_events(backend) for backend in self.live()))
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._events_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()

    # ------------------------------------------------------------- health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.check_health(backend) for backend in self.backends))

    async def check_health(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.mark_dead(backend, f"unreachable: {type(exc).__name__}: {exc}")
            return
        if response.status_code != 200:  # 200 with "degraded" still serves
            self.mark_dead(backend, f"/health answered {response.status_code}")
            return
        if not backend.alive:
            logger.info("backend %s is healthy", backend.url)
            backend.alive, backend.error, backend.events_seq = True, None, None
            backend.mirror = ReplicaCacheMirror()
            self._changed(backend)

    def mark_dead(self, backend: Backend, error: str) -> None:
        """Out of routing until /health answers again."""
        if backend.alive:
            logger.warning("backend %s left routing: %s", backend.url, error)
        backend.alive, backend.error = False, error
        self._changed(backend)

    def _changed(self, backend: Backend) -> None:
        if self.on_health_change is not None:
            self.on_health_change(backend)

    # ------------------------------------------------------------- events

    async def _events_loop(self) -> None:
        while True:
            await asyncio.sleep(self.events_interval_s)
            await asyncio.gather(*(self.refresh_events(backend) for backend in self.live()))

    async def refresh_events(self, backend: Backend) -> None:
        """Bring the backend's cache mirror up to date (quietly: health decides life)."""
        if not backend.events_on:
            return
        params = {} if backend.events_seq is None else {"after": backend.events_seq}
        try:
            response = await self.client.get(backend.url + "/v1/kv_events", params=params, headers=self.headers,
                                             timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return
        if response.status_code == 404:
            logger.warning("backend %s serves no KV events (start it with --enable-kv-events): "
                           "it is routed by load only", backend.url)
            backend.events_on = False
            return
        if response.status_code != 200:
            return
        self._apply(backend, response.json())

    @staticmethod
    def _apply(backend: Backend, log: dict[str, Any]) -> None:
        backend.block_size, backend.hash_algo = log["block_size"], log["hash_algo"]
        if log["snapshot"]:
            backend.mirror.block_hashes = {bytes.fromhex(h) for h in log["block_hashes"]}
        else:
            for kind, block_hash in log["events"]:
                if kind == "stored":
                    backend.mirror.block_hashes.add(bytes.fromhex(block_hash))
                else:
                    backend.mirror.block_hashes.discard(bytes.fromhex(block_hash))
        backend.events_seq = log["seq"]


__all__ = ["Backend", "BackendPool"]
