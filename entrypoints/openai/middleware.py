"""ASGI middleware that runs before any body is parsed, shared by `pagedllm
serve` and `pagedllm router`: the API key (`Authorization: Bearer <key>`),
the request body size limit and the time the body may take to arrive; and
HEAD answered as GET without the body. They answer with the OpenAI-shaped
error JSON."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Match

from pagedllm.entrypoints.openai.errors import error_json

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

# How long the whole request body may take to arrive after the headers
# (server.body_read_timeout_s's default; the router uses it as is).
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


async def _send_error(
    send: Send, status: int, message: str, param: str | None = None, close: bool = False
) -> None:
    body = error_json(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:  # the request was not read to its end: the connection cannot serve another
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """`Authorization: Bearer <key>` on every path but the open ones. The
    scheme is case-insensitive (RFC 9110); two Authorization headers are
    refused rather than one of them picked."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(values) > 1:
            await _send_error(send, 400, "authorization: send exactly one Authorization header", "authorization")
            return
        scheme, _, token = (values[0] if values else b"").strip().partition(b" ")
        # NOTE: constant-time compare, so the key cannot be guessed byte by byte.
        key_matches = hmac.compare_digest(token.strip(), self.expected)
        if scheme.lower() != b"bearer" or not key_matches:
            await _send_error(send, 401, "authorization: missing or invalid API key "
                              "(send 'Authorization: Bearer <key>')", "authorization")
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Reads the whole body first and refuses it (413) beyond `max_body_bytes`,
    so nothing is parsed from an oversized request; later receive() calls
    (the disconnect notice) go to the server untouched. A body that has not
    fully arrived `body_read_timeout_s` after the headers (a client that
    promised 1,000 bytes and sent 10) gets 408 and the connection is closed,
    so it holds no task and no socket for longer."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, limit_name: str = "server.max_body_bytes",
        body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
        timeout_name: str = "server.body_read_timeout_s",
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.limit_name = limit_name  # how the operator sets the limit, for the error
        self.body_read_timeout_s = body_read_timeout_s
        self.timeout_name = timeout_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                declared_bytes = int(declared)
            except ValueError:
                await _send_error(send, 400, "content-length: not an integer", "content-length")
                return
            if declared_bytes > self.max_body_bytes:
                await self._too_large(send, declared_bytes)
                return
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                body = await self._read_body(receive, send)
        except TimeoutError:
            await _send_error(
                send, 408, f"body: the request body did not arrive within {self.timeout_name} = "
                f"{self.body_read_timeout_s:g} s", "body", close=True,
            )
            return
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when the request was answered (413) or
        the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # Disconnected before the body was complete: nothing to serve.
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send, 413, f"body: the request body ({size} bytes or more) exceeds the limit "
            f"({self.limit_name} = {self.max_body_bytes})", "body",
        )


class HeadAsGetMiddleware:
    """HEAD on a GET route is answered as GET without the body (same status
    and headers, Content-Length included), as RFC 9110 asks; FastAPI's GET
    routes alone answer HEAD with 405. A path with a HEAD route of its own
    (/health) keeps it."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes  # the app's live list: routes added later count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD" or any(
            route.matches(scope)[0] == Match.FULL for route in self.routes
        ):
            await self.app(scope, receive, send)
            return

        async def send_without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_without_body)


__all__ = ["AuthMiddleware", "BodySizeLimitMiddleware", "HeadAsGetMiddleware"]
