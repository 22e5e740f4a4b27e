"""`pagedllm router`'s forwarding without servers: the backends are an
httpx MockTransport (nothing leaves the process), so each failure is exactly
the one a test names. A request a backend did not start (connection
refused, a 503, a stream closed before its first chunk) is retried on
another and the client never sees it; one that fails after it started is a
clear 502 (an error chunk and [DONE] when streaming); a backend's own 4xx
is the client's answer, not retried; /health is 200, 200 "degraded" or 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from pagedllm.entrypoints.router.app import build_app

FIRST, SECOND = "http://127.0.0.1:1", "http://127.0.0.1:2"
COMPLETION = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}
ANSWER = {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}}

Handler = Callable[[httpx.Request], httpx.Response]


def _app(handlers: dict[str, Handler], **options: Any) -> FastAPI:
    """The router over FIRST and SECOND, both live, each answered by its handler."""
    app = build_app([FIRST, SECOND], **options)
    pool = app.state.router.pool

    def dispatch(request: httpx.Request) -> httpx.Response:
        backend = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path in ("/v1/kv_events", "/v1/models"):
            return httpx.Response(404)
        return handlers[backend](request)

    pool.client = httpx.AsyncClient(transport=httpx.MockTransport(dispatch))
    for backend in pool.backends:
        backend.alive, backend.error = True, None
    return app


def _serving(seen: list[str]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json=ANSWER) if request.url.path != "/health" else httpx.Response(200)
    return handler


def _call(app: FastAPI, method: str, path: str, body: dict[str, Any] | None = None,
          **headers: str) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.request(method, path, json=body, headers=headers)
    return asyncio.run(go())


def _metric(app: FastAPI, name: str, backend: str) -> float:
    text = app.state.router.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'backend="{backend}"' in line)


def test_a_backend_that_refuses_the_connection_is_left_and_the_request_retried() -> None:
    def refusing(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    served: list[str] = []
    app = _app({FIRST: refusing, SECOND: _serving(served)})
    response = _call(app, "POST", "/v1/completions", COMPLETION)
    assert response.status_code == 200 and response.json() == ANSWER
    assert served == ["/v1/completions"]
    first = app.state.router.pool.backends[0]
    assert not first.alive and "unreachable" in first.error
    assert _metric(app, "pagedllm:router_retries_total", FIRST) == 1
    assert [_metric(app, "pagedllm:router_requests_total", url) for url in (FIRST, SECOND)] == [1, 1]
    # Out of routing now: the next request goes straight to the other backend.
    assert _call(app, "POST", "/v1/completions", COMPLETION).status_code == 200
    assert served == ["/v1/completions"] * 2
    assert _metric(app, "pagedllm:router_requests_total", FIRST) == 1


def test_a_503_before_any_token_is_retried_elsewhere() -> None:
    asked: list[str] = []

    def draining(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(503, json={"error": {"message": "draining"}})

    app = _app({FIRST: draining, SECOND: _serving([])})
    response = _call(app, "POST", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    # /tokenize (503: no ids, routed by load), the request, then its health check.
    assert asked == ["/tokenize", "/v1/chat/completions", "/health"]
    assert not app.state.router.pool.backends[0].alive


def test_a_backends_own_error_is_the_clients_answer_and_not_retried() -> None:
    served: list[str] = []

    def refusing_input(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "max_tokens=0 is invalid", "code": 400}})

    app = _app({FIRST: refusing_input, SECOND: _serving(served)})
    response = _call(app, "POST", "/v1/completions", {**COMPLETION, "max_tokens": 0})
    assert response.status_code == 400 and "max_tokens=0" in response.json()["error"]["message"]
    assert served == [] and app.state.router.pool.backends[0].alive


def test_a_backend_failing_mid_request_is_a_502_naming_it() -> None:
    def dying(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("server disconnected", request=request)

    app = _app({FIRST: dying, SECOND: _serving([])})
    response = _call(app, "POST", "/v1/completions", COMPLETION)
    assert response.status_code == 502
    assert response.json()["error"]["message"] == (
        f"backend {FIRST} failed while serving the request: RemoteProtocolError")


class _Chunks(httpx.AsyncByteStream):
    """A streamed body: these chunks, then (optionally) a broken connection."""

    def __init__(self, chunks: list[bytes], then_fail: bool) -> None:
        self.chunks, self.then_fail = chunks, then_fail

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.then_fail:
            raise httpx.ReadError("connection reset")


def _streaming(chunks: list[bytes], then_fail: bool = False) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunks(chunks, then_fail),
                              headers={"content-type": "text/event-stream"})
    return handler


def _stream_lines(app: FastAPI) -> list[str]:
    response = _call(app, "POST", "/v1/completions", {**COMPLETION, "stream": True})
    assert response.status_code == 200
    return [line for line in response.text.splitlines() if line]


def test_a_stream_closed_before_its_first_chunk_is_retried_elsewhere() -> None:
    good = [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
    app = _app({FIRST: _streaming([], then_fail=True), SECOND: _streaming(good)})
    assert _stream_lines(app) == ['data: {"choices": [{"text": "a"}]}', "data: [DONE]"]
    assert _metric(app, "pagedllm:router_retries_total", FIRST) == 1


def test_a_stream_broken_after_it_started_ends_with_an_error_chunk_and_done() -> None:
    app = _app({FIRST: _streaming([b'data: {"choices": [{"text": "a"}]}\n\n'], then_fail=True),
                SECOND: _serving([])})
    lines = _stream_lines(app)
    assert lines[0] == 'data: {"choices": [{"text": "a"}]}' and lines[-1] == "data: [DONE]"
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error == {"message": f"backend {FIRST} failed while streaming: ReadError", "type": "server_error",
                     "code": 502}
    assert not app.state.router.pool.backends[0].alive
    assert _metric(app, "pagedllm:router_retries_total", FIRST) == 0


def test_no_backend_left_is_a_503_and_health_says_how_many_serve() -> None:
    app = _app({FIRST: _serving([]), SECOND: _serving([])})
    assert _call(app, "GET", "/health").status_code == 200
    backends = app.state.router.pool.backends
    app.state.router.pool.mark_dead(backends[0], "unreachable: test")
    health = _call(app, "GET", "/health")
    assert health.status_code == 200
    assert health.json() == {"status": "degraded", "backends": [
        {"backend": FIRST, "alive": False, "error": "unreachable: test"}, {"backend": SECOND, "alive": True}]}
    assert _metric(app, "pagedllm:router_backend_healthy", FIRST) == 0
    app.state.router.pool.mark_dead(backends[1], "/health answered 503")
    assert _call(app, "GET", "/health").status_code == 503
    response = _call(app, "POST", "/v1/completions", COMPLETION)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "no backend is available (tried 0 of 2 backends)"


@pytest.mark.parametrize("given", [None, "Bearer wrong", "bearer router-key"])
def test_the_routers_key_is_required_and_the_backends_key_sent(given: str | None) -> None:
    sent: list[str | None] = []

    def backend(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("authorization"))
        return httpx.Response(200, json=ANSWER)

    app = _app({FIRST: backend, SECOND: backend}, api_key="router-key", backend_api_key="backend-key")
    headers = {} if given is None else {"authorization": given}
    response = _call(app, "POST", "/v1/completions", COMPLETION, **headers)
    if given == "bearer router-key":  # the scheme is case-insensitive, as on a server
        assert response.status_code == 200 and sent == ["Bearer backend-key"]
    else:
        assert response.status_code == 401 and sent == []
    assert _call(app, "GET", "/health").status_code == 200  # open without a key


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    served: list[str] = []
    app = _app({FIRST: _serving(served), SECOND: _serving(served)}, max_body_bytes=2048)
    response = _call(app, "POST", "/v1/completions", {**COMPLETION, "prompt": "x" * 4096})
    assert response.status_code == 413 and "(--max-body-bytes = 2048)" in response.json()["error"]["message"]
    assert served == []


def test_a_body_not_sent_as_json_is_refused_and_head_answers_as_get() -> None:
    served: list[str] = []
    app = _app({FIRST: _serving(served), SECOND: _serving(served)})
    # The router forwards as JSON whatever it parsed: it must refuse what a web page could send.
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = _call(app, "POST", "/v1/completions", COMPLETION, **{"content-type": content_type})
        assert response.status_code == 415, (content_type, response.text)
        assert response.json()["error"]["param"] == "content-type"
    assert served == []
    head = _call(app, "HEAD", "/health")
    assert (head.status_code, head.content) == (200, b"")
