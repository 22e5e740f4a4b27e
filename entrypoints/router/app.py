"""`pagedllm router`: the HTTP front door over several `pagedllm serve` backends.

    pagedllm router --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 \\
        [--policy prefix_aware] [--port 8000] [--api-key KEY] [--backend-api-key KEY]

Each completion or chat request goes to the backend the routing policy picks
(plugin kind `router`; `prefix_aware` by default): the router learns what
each backend's prefix caches hold from its GET /v1/kv_events (backends run
with --enable-kv-events), takes the prompt's token ids from a backend's
/tokenize (so chat templates apply exactly as on the backends), hashes its
blocks the backends' way (their block size and algorithm, the request's
`cache_salt`) and sees how much of it each backend holds.

A request that fails before it started (the backend refused the connection
or answered 503 without a token) is retried on another backend; one that
fails after it started gets a clear error (502, or an error chunk and
[DONE] when streaming). Backends that fail /health leave routing until they
answer again; /health here is 200 (all live), 200 with
{"status": "degraded", ...} (some), 503 (none). The router has its own API
key (`--api-key`); backends may have theirs (`--backend-api-key`).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pagedllm.entrypoints.openai.errors import error_body
from pagedllm.entrypoints.openai.middleware import AuthMiddleware, BodySizeLimitMiddleware, HeadAsGetMiddleware
from pagedllm.entrypoints.openai.request_body import json_content_type_problem
from pagedllm.entrypoints.router.backend_pool import Backend, BackendPool
from pagedllm.plugins import get_plugin_manager
from pagedllm.routers.base import ReplicaState, RouteRequest, RoutingPolicy
from pagedllm.routers.cache_mirror import PromptHasher

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
OPEN_PATHS = frozenset({"/health"})
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a server's default (server.max_body_bytes)
# Fields of a chat request that shape its prompt (what /tokenize takes).
# Seconds the backends' adapter digests (their /v1/models) are reused before asked again.
LORA_DIGESTS_TTL_S = 2.0
_CHAT_PROMPT_FIELDS = ("messages", "add_generation_prompt", "chat_template", "chat_template_kwargs")


class RetryElsewhere(Exception):
    """The backend did not start the request: another one may take it."""


class RouterMetrics:
    def __init__(self, backends: list[Backend]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["backend"]

        def counter(name: str, doc: str) -> Counter:
            return Counter("pagedllm:router_" + name, doc, labels, registry=self.registry)

        self.requests = counter("requests", "Requests routed to each backend.")
        self.prefix_routed = counter("prefix_routed_requests", "Requests routed for the prefix a backend caches.")
        self.predicted_hits = counter("predicted_hit_tokens", "Prompt tokens the router expected cached.")
        self.actual_hits = counter("actual_hit_tokens", "Prompt tokens the backend reported cached.")
        self.retries = counter("retries", "Requests a backend did not start, sent on to another.")
        self.healthy = Gauge("pagedllm:router_backend_healthy", "1 while a backend is in routing.", labels,
                             registry=self.registry)
        for backend in backends:
            for metric in (self.requests, self.prefix_routed, self.predicted_hits, self.actual_hits, self.retries):
                metric.labels(backend.url)
            self.healthy.labels(backend.url).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class Routed:
    backend: Backend
    predicted_hit_tokens: int


class Router:
    """Picks a backend for each request and forwards it."""

    def __init__(self, pool: BackendPool, policy: RoutingPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = RouterMetrics(pool.backends)
        pool.on_health_change = lambda backend: self.metrics.healthy.labels(backend.url).set(int(backend.alive))
        self._hashers: dict[tuple[int, str], PromptHasher] = {}
        self._request_ids = itertools.count()
        # Adapter name -> content digest, as a backend's /v1/models said (lora_digest).
        self._lora_digests: dict[str, str] = {}
        self._lora_digests_at = float("-inf")

    # ------------------------------------------------------------ routing

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The (first) prompt's token ids, as the backends will see them;
        None when no backend can say (routing then weighs load only)."""
        if path.endswith("/completions") and "messages" not in body:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
                return prompt
            request: dict[str, Any] = {"prompt": prompt}
        else:
            request = {key: body[key] for key in _CHAT_PROMPT_FIELDS if key in body}
        for backend in self.pool.live():
            try:
                response = await self.pool.client.post(backend.url + "/tokenize", json=request,
                                                        headers=self.pool.headers)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                tokens: list[int] = response.json()["tokens"]
                return tokens
            return None  # the request's own problem: its backend will say so
        return None

    async def lora_digest(self, model: Any) -> str | None:
        """The content digest of the adapter `model` names (the backends list
        it in /v1/models as `lora_digest`), which their prefix caches hash
        its blocks with; None for the base model or when no backend says.

        NOTE: the list is asked again once it is LORA_DIGESTS_TTL_S old: a
        name reloaded with other weights is predicted with its old digest
        for at most that long, which can only misroute (hits are decided by
        each engine's own hashes), never serve other KV."""
        if not isinstance(model, str):
            return None
        now = time.monotonic()
        if now - self._lora_digests_at >= LORA_DIGESTS_TTL_S:
            self._lora_digests, self._lora_digests_at = await self._fetch_lora_digests(), now
        return self._lora_digests.get(model)

    async def _fetch_lora_digests(self) -> dict[str, str]:
        for backend in self.pool.live():
            try:
                response = await self.pool.client.get(backend.url + "/v1/models", headers=self.pool.headers)
                cards = response.json().get("data") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if not isinstance(cards, list):
                return {}
            return {card["id"]: card["lora_digest"] for card in cards
                    if isinstance(card, dict) and isinstance(card.get("id"), str)
                    and isinstance(card.get("lora_digest"), str)}
        return {}

    def choose(self, request_id: str, tokens: list[int] | None, cache_salt: str | None,
               exclude: set[int], lora_digest: str | None = None) -> Routed:
        live = [backend for backend in self.pool.live() if backend.index not in exclude]
        if not live:
            raise RetryElsewhere("no backend is available")
        states = [
            ReplicaState(backend.index, backend.in_flight, backend.in_flight, 0,
                         self._cached_tokens(backend, tokens, cache_salt, lora_digest), backend.num_routed)
            for backend in live
        ]
        decision = self.policy.route(RouteRequest(request_id, len(tokens or ())), states)
        chosen = next((state for state in states if state.index == decision.replica), None)
        if chosen is None:
            raise RuntimeError(f"routing policy chose backend {decision.replica}, not a live one")
        backend = self.pool.backends[chosen.index]
        backend.num_routed += 1
        self.metrics.requests.labels(backend.url).inc()
        if decision.reason == "prefix":
            self.metrics.prefix_routed.labels(backend.url).inc()
        return Routed(backend, chosen.num_cached_tokens)

    def _cached_tokens(
        self, backend: Backend, tokens: list[int] | None, cache_salt: str | None, lora_digest: str | None = None
    ) -> int:
        if tokens is None or backend.block_size is None or backend.hash_algo is None:
            return 0
        key = (backend.block_size, backend.hash_algo)
        hasher = self._hashers.get(key)
        if hasher is None:
            hasher = self._hashers[key] = PromptHasher(*key)
        return backend.mirror.num_cached_blocks(hasher(tokens, cache_salt, lora_digest)) * backend.block_size

    # --------------------------------------------------------- forwarding

    async def forward(self, path: str, body: dict[str, Any]) -> Response:
        tokens = await self.prompt_tokens(path, body)
        cache_salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        lora_digest = await self.lora_digest(body.get("model")) if tokens is not None else None
        send = self._stream if body.get("stream") else self._post
        request_id = f"router-{next(self._request_ids)}"
        tried: set[int] = set()
        while True:
            try:
                routed = self.choose(request_id, tokens, cache_salt, tried, lora_digest)
            except RetryElsewhere as exc:
                return _error(503, f"{exc} (tried {len(tried)} of {len(self.pool.backends)} backends)")
            tried.add(routed.backend.index)
            routed.backend.in_flight += 1
            try:
                return await send(routed, path, body)
            except RetryElsewhere as exc:
                logger.warning("backend %s did not take the request (%s); trying another", routed.backend.url, exc)
                self.metrics.retries.labels(routed.backend.url).inc()
            finally:
                routed.backend.in_flight -= 1

    async def _post(self, routed: Routed, path: str, body: dict[str, Any]) -> Response:
        backend = routed.backend
        try:
            response = await self.pool.client.post(backend.url + path, json=body, headers=self.pool.headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.pool.mark_dead(backend, f"unreachable: {exc}")
            raise RetryElsewhere(str(exc)) from exc
        except httpx.HTTPError as exc:
            self.pool.mark_dead(backend, f"failed mid-request: {type(exc).__name__}: {exc}")
            return _error(502, f"backend {backend.url} failed while serving the request: {type(exc).__name__}")
        if response.status_code == 503:  # refused or failed with no token: another may serve it
            await self.pool.check_health(backend)
            raise RetryElsewhere(f"503: {response.text[:200]}")
        if response.status_code == 200:
            usage = response.json().get("usage") or {}
            actual = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(actual, int):
                self.metrics.predicted_hits.labels(backend.url).inc(routed.predicted_hit_tokens)
                self.metrics.actual_hits.labels(backend.url).inc(actual)
            await self.pool.refresh_events(backend)  # the next decision sees what this one cached
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    async def _stream(self, routed: Routed, path: str, body: dict[str, Any]) -> Response:
        backend = routed.backend
        upstream = self.pool.client.build_request("POST", backend.url + path, json=body, headers=self.pool.headers)
        try:
            response = await self.pool.client.send(upstream, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.pool.mark_dead(backend, f"unreachable: {exc}")
            raise RetryElsewhere(str(exc)) from exc
        except httpx.HTTPError as exc:
            return _error(502, f"backend {backend.url} failed before answering: {type(exc).__name__}")
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            if response.status_code == 503:
                await self.pool.check_health(backend)
                raise RetryElsewhere(f"503: {content[:200]!r}")
            return Response(content, status_code=response.status_code, media_type="application/json")
        chunks = response.aiter_raw()
        try:
            first = await anext(chunks)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            await response.aclose()
            self.pool.mark_dead(backend, f"closed the stream before its first chunk: {exc!r}")
            raise RetryElsewhere("the stream ended before its first chunk") from exc
        backend.in_flight += 1  # the relay outlives this call

        async def relay() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as exc:
                self.pool.mark_dead(backend, f"failed mid-stream: {type(exc).__name__}")
                message = f"backend {backend.url} failed while streaming: {type(exc).__name__}"
                error = {"error": {"message": message, "type": "server_error", "code": 502}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                backend.in_flight -= 1
                await response.aclose()
                await self.pool.refresh_events(backend)

        return StreamingResponse(relay(), media_type="text/event-stream")


def build_app(backend_urls: list[str], *, policy: str = "prefix_aware", api_key: str | None = None,
              backend_api_key: str | None = None, health_interval_s: float = 1.0,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    plugin_manager = get_plugin_manager()
    plugin_manager.load()
    policy_cls = plugin_manager.routers.load(policy)  # UnknownComponentError lists the names
    pool = BackendPool(backend_urls, api_key=backend_api_key, health_interval_s=health_interval_s)
    router = Router(pool, policy_cls())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        yield
        await pool.close()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    app.state.router = router

    # The server's own middleware: the same key semantics, and no body parsed past the limit.
    app.add_middleware(HeadAsGetMiddleware, routes=app.routes)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes, limit_name="--max-body-bytes",
                       timeout_name="the router's body read timeout")
    if api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=api_key, open_paths=OPEN_PATHS)

    async def proxy(request: Request) -> Response:
        # As the servers do: a body not sent as JSON could come from any web page (no CORS preflight).
        problem = json_content_type_problem(request.headers.getlist("content-type"))
        if problem is not None:
            return JSONResponse(error_body(415, problem, "content-type"), status_code=415)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        return await router.forward(request.url.path, body)

    for route in ROUTES:
        app.add_api_route(route, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        for backend in pool.live():
            try:
                response = await pool.client.get(backend.url + "/v1/models", headers=pool.headers)
            except httpx.HTTPError:
                continue
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        return _error(503, "no backend is available")

    @app.get("/health")
    async def health() -> Response:
        live = pool.live()
        if not live:
            return _error(503, "no backend is available: " + "; ".join(
                f"{b.url}: {b.error}" for b in pool.backends))
        if len(live) < len(pool.backends):
            return JSONResponse({"status": "degraded", "backends": [b.describe() for b in pool.backends]})
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError"}.get(status, "ServiceUnavailableError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def run_router(backend_urls: list[str], *, policy: str, host: str, port: int, api_key: str | None,
               backend_api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serve until SIGTERM / SIGINT, then exit 0 (uvicorn's own run would
    re-raise the signal, so the process would die by it)."""
    import uvicorn

    from pagedllm.entrypoints.openai.draining_server import CleanExitServer

    app = build_app(backend_urls, policy=policy, api_key=api_key, backend_api_key=backend_api_key,
                    max_body_bytes=max_body_bytes)
    CleanExitServer(uvicorn.Config(app, host=host, port=port, log_level="info")).run()


__all__ = ["Router", "build_app", "run_router"]
