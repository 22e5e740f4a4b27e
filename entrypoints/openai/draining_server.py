"""uvicorn's Server with pagedllm's shutdown: drain, then end what is left.

On SIGTERM / SIGINT uvicorn leaves its main loop and calls `shutdown()`;
here that first

1. stops taking work: every open connection closes after its current
   response (an idle keep-alive one at once), and a request that arrives
   from now on (a new connection is still accepted) is answered 503 and its
   connection closed: `/health` says `{"status": "draining", "error": ...}`
   (a load balancer's probe must see the drain, not a refused connection),
   anything else gets the shutdown's error; the listening sockets close
   only when the drain is over;
2. waits until no HTTP request is in flight, at most `drain_timeout_s`
   (a second SIGINT skips the wait);
3. ends the engine's remaining requests (`AsyncLLM.end_all_requests`): a
   non-streaming client gets an OpenAI-shaped 503, a stream an error chunk
   then `data: [DONE]`; later requests are refused the same way;

then uvicorn's own shutdown waits (`timeout_graceful_shutdown`) for those
answers to be written and runs the lifespan shutdown, which stops the engine
core. The signal is not re-raised afterwards (uvicorn would, so the process
would die *by* SIGTERM): a drained server exits 0.

Engine-core death: unless `keep_alive_on_engine_death`, the server notices
within a tick (0.1 s), shuts down the same way without waiting (every
request in flight gets its 503 or error chunk) and `engine_dead_error` is
set, so `serve()` can exit non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, cast

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from pagedllm.core.errors import EngineDeadError
from pagedllm.entrypoints.openai.errors import error_body

if TYPE_CHECKING:
    import socket

    from starlette.types import ASGIApp, Receive, Scope, Send

    from pagedllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# How often the drain looks whether the last request finished.
DRAIN_POLL_S = 0.05


class DrainGate:
    """ASGI middleware in front of the whole app: once `draining` is set,
    every request that arrives is answered 503 at once (what was in flight
    before goes on), and its connection closes after the answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.draining:
            await self.app(scope, receive, send)
            return
        body = error_body(503, "the server is draining: it is shutting down and takes no new requests")
        if scope["path"] == "/health":
            body = {"status": "draining", **body}
        content = b"" if scope["method"] == "HEAD" else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": content})


class CleanExitServer(uvicorn.Server):
    """uvicorn's Server, minus re-raising the handled signal once serving is
    over: uvicorn would, so the process would die *by* SIGTERM (exit -15)
    instead of exiting 0 after a clean shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original_handlers = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original_handlers.items():
                signal.signal(sig, handler)


class DrainingServer(CleanExitServer):
    def __init__(
        self, config: uvicorn.Config, engine: AsyncLLM, *, drain_timeout_s: float,
        keep_alive_on_engine_death: bool = False,
    ) -> None:
        # NOTE: the config's app is an ASGI app object (serve()'s FastAPI app), not an import string.
        self.gate = DrainGate(cast("ASGIApp", config.app))
        config.app = self.gate
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        # Set when the engine core's death ended the server (the exit policy).
        self.engine_dead_error: EngineDeadError | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_dead_error is None and not self.keep_alive_on_engine_death and self.engine.errored:
            self.engine_dead_error = self.engine.engine_core.dead_error or EngineDeadError("the engine core died")
            logger.error("%s; ending the requests in flight and exiting (server.keep_alive_on_engine_death "
                         "is off)", self.engine_dead_error)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.drain()
        await super().shutdown(sockets=sockets)

    async def drain(self) -> None:
        """Steps 1-3 of the module docstring."""
        self.gate.draining = True
        for connection in list(self.server_state.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        if self.server_state.tasks and not self.engine.errored:
            logger.info("draining %d request(s) for up to %g s (server.drain_timeout_s)",
                        len(self.server_state.tasks), self.drain_timeout_s)
        while (self.server_state.tasks and loop.time() < deadline and not self.force_exit
               and not self.engine.errored):
            await asyncio.sleep(DRAIN_POLL_S)
        reason = "the server is shutting down"
        if self.engine.errored:
            reason = "the engine core died; the server is shutting down"
        num_ended = self.engine.end_all_requests(reason)
        if num_ended:
            logger.warning("ended %d unfinished request(s) with 503: %s", num_ended, reason)
