"""`pagedllm disagg-proxy`: disaggregated prefill through two servers.

    pagedllm disagg-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--port 8000]

Each completion or chat request goes first to the prefill server with
`max_tokens` 1 (it computes the prompt's KV blocks, and a `kv_transfer`
producer stores them), then unchanged to the decode server (a consumer
loads those blocks instead of recomputing them) whose answer, streamed or
not, is the client's. Both servers must run the same model with a
connector that shares blocks (e.g. `shared_storage` on one directory).
The client's Authorization header is passed to both.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.entrypoints.openai.request_body import json_content_type_problem

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Fields that make the prefill request generate more than its one token.
_PREFILL_OVERRIDES: dict[str, Any] = {"max_tokens": 1, "stream": False, "n": 1}
_PREFILL_DROPPED = ("max_completion_tokens", "stream_options", "min_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: same prompt, one token, no stream."""
    return {**{k: v for k, v in body.items() if k not in _PREFILL_DROPPED}, **_PREFILL_OVERRIDES}


def build_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    client = httpx.AsyncClient(timeout=timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedllm disagg-proxy", lifespan=lifespan)

    def forwarded_headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def proxy(request: Request) -> Response:
        # As the servers do: a body not sent as JSON could come from any web page (no CORS preflight).
        problem = json_content_type_problem(request.headers.getlist("content-type"))
        if problem is not None:
            return JSONResponse(error_body(415, problem, "content-type"), status_code=415)
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = forwarded_headers(request)
        path = request.url.path
        try:
            prefill = await client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill server {prefill_url} unreachable: {exc}")
        if prefill.status_code != 200:
            # The client's own mistake (400) or the prefill server's trouble: say which.
            return Response(prefill.content, status_code=prefill.status_code, media_type="application/json")
        if body.get("stream"):
            upstream = client.build_request("POST", decode_url + path, json=body, headers=headers)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                return _error(502, f"decode server {decode_url} unreachable: {exc}")
            if response.status_code != 200:
                content = await response.aread()
                await response.aclose()
                return Response(content, status_code=response.status_code, media_type="application/json")

            async def relay() -> Any:
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()

            return StreamingResponse(relay(), media_type="text/event-stream")
        try:
            decoded = await client.post(decode_url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"decode server {decode_url} unreachable: {exc}")
        return Response(decoded.content, status_code=decoded.status_code, media_type="application/json")

    for route in ROUTES:
        app.add_api_route(route, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        response = await client.get(decode_url + "/v1/models", headers=forwarded_headers(request))
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    return _error(503, f"{url} is not healthy")
            except httpx.HTTPError as exc:
                return _error(503, f"{url} unreachable: {exc}")
        return Response(status_code=200)

    return app


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def run_proxy(prefill_url: str, decode_url: str, host: str, port: int) -> None:
    import uvicorn

    from pagedllm.entrypoints.openai.draining_server import CleanExitServer

    # Not uvicorn.run: it re-raises SIGTERM after shutting down, so the process would exit -15.
    CleanExitServer(uvicorn.Config(build_app(prefill_url, decode_url), host=host, port=port,
                                   log_level="info")).run()
