"""ASGI middleware that runs before any body is parsed, shared by `pagedllm
serve` and `pagedllm router`: the API key (`Authorization: Bearer <key>`) and
the request body size limit. Both answer with the OpenAI-shaped error JSON."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from pagedllm.entrypoints.openai.errors import error_json

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


async def _send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = error_json(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
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
    (the disconnect notice) go to the server untouched."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, limit_name: str = "server.max_body_bytes") -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.limit_name = limit_name  # how the operator sets the limit, for the error

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
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # Disconnected before the body was complete: nothing to serve.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(
            send, 413, f"body: the request body ({size} bytes or more) exceeds the limit "
            f"({self.limit_name} = {self.max_body_bytes})", "body",
        )


__all__ = ["AuthMiddleware", "BodySizeLimitMiddleware"]
