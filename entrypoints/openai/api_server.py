"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of AsyncLLM.

`build_app(engine, config)` makes the app; `run_server(config)` starts the
engine core process, then serves until SIGINT/SIGTERM and shuts both down.
Auth and the body size limit are plain ASGI middleware so they run before any
body is parsed (and apply to every route, /docs and /openapi.json included).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.core.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineUnresponsiveError,
    InvalidRequestError,
)
from pagedllm.core.startup_heap import freeze_startup_heap
from pagedllm.entrypoints.openai.errors import (
    OpenAIServingError,
    describe_validation_error,
    error_body,
    internal_error_message,
    invalid_request_message,
)
from pagedllm.entrypoints.openai.lora_models import LoRAModels, load_lora_resolvers
from pagedllm.entrypoints.openai.middleware import AuthMiddleware, BodySizeLimitMiddleware, HeadAsGetMiddleware
from pagedllm.entrypoints.openai.openapi_limits import state_server_limits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    KVEventsResponse,
    LoadLoRAAdapterRequest,
    MemoryUsageResponse,
    ModelCard,
    ModelList,
    ServerInfoResponse,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from pagedllm.entrypoints.openai.request_body import add_model_schemas, body_openapi, parse_body
from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool, shared_request_pool
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from pagedllm.entrypoints.openai.tool_calls import load_tool_parser

if TYPE_CHECKING:

    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Routes that answer without the API key.
ALWAYS_OPEN_PATHS = frozenset({"/health"})
# Seconds uvicorn waits, after the drain ended every engine request, for
# their answers to be written before it cancels what is left.
GRACEFUL_SHUTDOWN_S = 5
# /health documents what it answers: no body on 200, the error JSON on 503.
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine core answered a ping in time (no body; with data-parallel replicas "
                         "of which some died or do not answer: `{\"status\": \"degraded\", \"replicas\": [...]}`)",
          "content": None},
    503: {"description": "The engine core died or did not answer within server.health_timeout_s, or the "
                         "server is draining (shutting down: `{\"status\": \"draining\", \"error\": ...}`)",
          "model": ErrorResponse},
}
HEALTH_HEAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine core answered a ping in time", "content": None},
    503: {"description": "The engine core died or did not answer within server.health_timeout_s, or the "
                         "server is draining", "content": None},
}

# /tokenize takes exactly one of prompt and messages; the template fields
# apply to messages only ({} asks for nothing).
TOKENIZE_ONE_OF = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ],
    "anyOf": [{"required": ["messages"], "properties": {"messages": {"type": "array"}}}, {"properties": {
        "chat_template": {"type": "null"},
        "chat_template_kwargs": {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]},
    }}],
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)
}
# Routes that take a JSON body also answer 408 (the body did not arrive in
# time) and 415 (it was not sent as application/json).
BODY_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES, **{status: {"model": ErrorResponse} for status in (408, 415)}
}


def _error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIServingError)
    async def serving_error(_: Request, exc: OpenAIServingError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error_response(400, invalid_request_message(exc), exc.field)

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        return _error_response(503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(503, f"the engine is not running: {exc}")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(list(exc.errors()))
        return _error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not decode the body (e.g. invalid UTF-8, nested too deep)
            return _error_response(400, f"body: the request body is not valid JSON ({exc.detail})", "body")
        # NOTE: keep the exception's headers: a 405 must say what is Allowed.
        return _error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(500, internal_error_message(exc, "in a request handler"))


def build_app(engine: AsyncLLM, config: EngineConfig, lora_models: LoRAModels | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (and the adapters of `lora_models`,
    loaded already: see `start_lora_models`); shutting the app down shuts
    the engine down."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # NOTE: the engine stops with the app, whichever ASGI server runs it
            # (serve() stops it again after DrainingServer returns: idempotent).
            engine.shutdown()

    # NOTE: no /docs or /redoc: FastAPI's pages load their scripts from a CDN
    # (blank offline, and third-party code on the operator's origin);
    # /openapi.json is the contract and works with any viewer.
    app = FastAPI(
        title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan,
        docs_url=None, redoc_url=None,
    )
    key_open_paths = _open_paths(config) if config.server.api_key else None
    app.openapi = lambda: _openapi_schema(  # type: ignore[method-assign]
        app, key_open_paths, engine.vocab_size, config.server.trust_request_chat_template
    )
    _add_exception_handlers(app)
    completion = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine)
    tokenization = OpenAIServingTokenization(engine)
    model_name = completion.model_name
    if lora_models is None:
        registry = getattr(engine, "lora_registry", None)
        lora_models = LoRAModels(config.lora, completion.served_model_names, completion.pool.run,
                                 register=None if registry is None else registry.register)
    for handler in (completion, chat, tokenization):
        handler.lora_models = lora_models

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health() -> Response:
        """200 (no body) when the engine core answered a ping within
        `server.health_timeout_s`; 503 with an error body when it died or
        did not answer."""
        problem = await _health_problem(engine)
        if problem is not None:
            return _error_response(503, problem)
        replicas = engine.replica_health()
        if replicas is not None and not all(replica["alive"] and replica["responsive"] for replica in replicas):
            # Some data-parallel replicas died or stopped answering, the others serve: degraded, still 200.
            return JSONResponse({"status": "degraded", "replicas": replicas})
        return Response(status_code=200)

    @app.head("/health", response_class=Response, responses=HEALTH_HEAD_RESPONSES)
    async def health_head() -> Response:
        """GET /health without a body: 200 or 503."""
        return Response(status_code=200 if await _health_problem(engine) is None else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/kv_events", response_model=KVEventsResponse, responses=ERROR_RESPONSES)
    async def kv_events(after: Annotated[int | None, Query(ge=0)] = None) -> Response:
        """The block hashes this server's prefix caches gained and lost after
        change number `after` (a snapshot of all it holds without it, or when
        `after` fell out of the kept window), with the block size and hash
        algorithm they were made with: what `pagedllm router` mirrors."""
        log = engine.kv_event_log
        if log is None:
            return _error_response(404, "KV events are off: start the server with --enable-kv-events")
        return JSONResponse(log.read(after))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedllm.__version__)

    @app.get("/server_info", response_model=ServerInfoResponse)
    async def server_info() -> ServerInfoResponse:
        """Process ids (for supervisors and tests) and the served model."""
        return ServerInfoResponse(
            version=pagedllm.__version__, model=model_name, max_model_len=engine.max_model_len,
            api_pid=os.getpid(), engine_pid=engine.engine_pid, engine_pids=engine.engine_pids,
            default_sampling_params=completion.default_sampling_params,
        )

    @app.get("/memory_usage", response_model=MemoryUsageResponse, responses=ERROR_RESPONSES)
    async def memory_usage() -> Response:
        """What each engine rank holds: weights, KV cache, and the KV cache's
        pages resident in host memory (the part of a CPU engine's RSS that
        grows as KV blocks are first used). 503 when the engine does not answer."""
        timeout_s = config.server.health_timeout_s
        try:
            ranks = await asyncio.wait_for(engine.memory_usage(), timeout_s)
        except TimeoutError:
            return _error_response(503, str(EngineUnresponsiveError(timeout_s)))
        return JSONResponse(MemoryUsageResponse(ranks=ranks).model_dump())

    @app.get("/v1/models", response_model=ModelList)
    async def show_models() -> ModelList:
        # NOTE: root is the served name, never the model folder's path on this
        # host; an adapter's root is the folder the operator gave (vLLM's).
        cards = [ModelCard(id=name, root=name, max_model_len=engine.max_model_len)
                 for name in completion.served_model_names]
        cards += [ModelCard(id=lora.ref.name, root=lora.ref.path, parent=lora.parent,
                            max_model_len=engine.max_model_len, lora_digest=lora.ref.digest)
                  for lora in lora_models]
        return ModelList(data=cards)

    if lora_models.runtime_updating:
        _add_lora_routes(app, lora_models, completion.pool)

    # NOTE: the bodies are parsed by parse_body (off the event loop when large),
    # not by FastAPI; body_openapi documents them.
    pool = completion.pool

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_streaming_responses(),
              openapi_extra=body_openapi(CompletionRequest))
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest, pool)
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_streaming_responses(),
              openapi_extra=body_openapi(ChatCompletionRequest))
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest, pool)
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=BODY_ERROR_RESPONSES,
              openapi_extra=body_openapi(TokenizeRequest, TOKENIZE_ONE_OF))
    async def tokenize(raw_request: Request) -> Response:
        request = await parse_body(raw_request, TokenizeRequest, pool)
        return await tokenization.tokenize(request, raw_request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=BODY_ERROR_RESPONSES,
              openapi_extra=body_openapi(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> Response:
        request = await parse_body(raw_request, DetokenizeRequest, pool)
        return await tokenization.detokenize(request, raw_request)

    # Added last = outermost: auth first, then the body limit (and its read
    # timeout), then HEAD as GET, then routing.
    app.add_middleware(HeadAsGetMiddleware, routes=app.routes)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.server.max_body_bytes,
                       body_read_timeout_s=config.server.body_read_timeout_s)
    if config.server.api_key:
        app.add_middleware(AuthMiddleware, api_key=config.server.api_key, open_paths=_open_paths(config))
    return app


def _add_lora_routes(app: FastAPI, lora_models: LoRAModels, pool: RequestWorkerPool) -> None:
    """vLLM's runtime adapter routes (mounted only when the operator allows
    runtime updates: a 404 otherwise, as in vLLM)."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=BODY_ERROR_RESPONSES,
              openapi_extra=body_openapi(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw_request: Request) -> Response:
        """Load a PEFT adapter folder under a name requests can use as `model`
        (validated, off the event loop); a bad adapter is a 400 and changes nothing."""
        request = await parse_body(raw_request, LoadLoRAAdapterRequest, pool)
        _, loaded = await lora_models.load(request.lora_name, request.lora_path)
        if not loaded:
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' is already loaded.")
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=BODY_ERROR_RESPONSES,
              openapi_extra=body_openapi(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw_request: Request) -> Response:
        """Stop serving an adapter name (requests already running finish); 404 if unknown."""
        request = await parse_body(raw_request, UnloadLoRAAdapterRequest, pool)
        lora_models.unload(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


async def start_lora_models(engine: AsyncLLM, config: EngineConfig) -> LoRAModels:
    """The server's adapter registry with every `--lora-modules` adapter
    loaded (in worker threads); ConfigError naming the first bad one."""
    served = [engine.model_name] + [n for n in config.server.served_model_name or [] if n != engine.model_name]
    pool = shared_request_pool(engine, config.server.request_worker_threads)
    registry = engine.lora_registry
    lora_models = LoRAModels(
        config.lora, served, pool.run, register=None if registry is None else registry.register,
        resolvers=load_lora_resolvers(config.lora),
    )
    await lora_models.load_startup_modules()
    return lora_models


def _open_paths(config: EngineConfig) -> frozenset[str]:
    """Paths that answer without the API key."""
    return ALWAYS_OPEN_PATHS | ({"/metrics"} if config.server.allow_unauthenticated_metrics else frozenset())


def _streaming_responses() -> dict[int | str, dict[str, Any]]:
    """The error answers, and 200 as either JSON or (stream: true) server-sent events."""
    # NOTE: in OpenAPI 3.1 the schema of an event stream describes one event.
    event = {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
        "description": "One server-sent event: data is a chunk's JSON (or an error's, "
                       '{"error": {...}}); the last event\'s data is [DONE].',
    }
    events = {"text/event-stream": {"schema": event}}
    return {**BODY_ERROR_RESPONSES, 200: {"content": events}}


def _openapi_schema(
    app: FastAPI, key_open_paths: frozenset[str] | None, vocab_size: int, trust_request_chat_template: bool
) -> dict[str, Any]:
    """FastAPI's schema, made to list what the server answers: no 422 (a
    validation error is a 400 here, OpenAI's status), this server's limits
    (openapi_limits.py) and, with an API key (`key_open_paths` not None), the
    bearer scheme and a 401 on every route that needs it."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {})
        body_models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                              DetokenizeRequest]
        if "/v1/load_lora_adapter" in schema.get("paths", {}):
            body_models += [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]
        add_model_schemas(components, body_models)
        state_server_limits(components["schemas"], vocab_size, trust_request_chat_template)
        for unused in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(unused, None)
        if key_open_paths is not None:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
        for path, path_item in schema.get("paths", {}).items():
            for operation in path_item.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if key_open_paths is not None and path not in key_open_paths:
                    operation["security"] = [{"bearer": []}]
                    responses.setdefault("401", {
                        "description": "Missing or invalid API key",
                        "content": {"application/json": {"schema": error_ref}},
                    })
        app.openapi_schema = schema
    return app.openapi_schema


async def _health_problem(engine: AsyncLLM) -> str | None:
    """Why /health fails (the engine core died or did not answer a ping in
    time), or None when it is healthy."""
    try:
        result = engine.check_health()
        if inspect.isawaitable(result):
            await result
    except EngineDeadError as exc:
        return f"the engine is not running: {exc}"
    except EngineUnresponsiveError as exc:
        return str(exc)
    return None


async def serve(config: EngineConfig, engine_core: Any = None) -> None:
    """Start the engine core, then serve HTTP until a shutdown signal.

    Shutdown (SIGTERM / SIGINT): new requests are answered 503 (/health:
    `"status": "draining"`), requests in flight may finish for
    `server.drain_timeout_s`, then the rest end with an OpenAI-shaped 503 (a
    stream: an error chunk, then `data: [DONE]`); the engine core stops and
    the process exits 0 (DrainingServer).

    Engine-core death: every request in flight ends the same way (503 / an
    error chunk and [DONE]) and /health answers 503. By default the API
    process then exits non-zero (EngineDeadError, exit code 1) so a
    supervisor restarts the whole server, as vLLM does; with
    `server.keep_alive_on_engine_death` it stays up answering 503 until it
    is stopped. Either way no process is left behind: the core is reaped,
    and a core whose API process dies exits on its own (PR_SET_PDEATHSIG).

    `engine_core`: a core started already (`start_async_engine_core`), which
    the AsyncLLM takes over; None: the AsyncLLM starts it.
    """
    try:
        import uvicorn

        from pagedllm.engine.async_llm import AsyncLLM
        from pagedllm.entrypoints.openai.draining_server import DrainingServer

        load_tool_parser(config.server)  # a bad --tool-call-parser fails before the engine starts
    except BaseException:
        if engine_core is not None:
            engine_core.shutdown()
        raise
    engine = await _start_engine(AsyncLLM, config, engine_core)
    server: DrainingServer | None = None
    try:
        app = build_app(engine, config, await start_lora_models(engine, config))
        server_config = uvicorn.Config(
            app, host=config.server.host, port=config.server.port, log_level=_uvicorn_log_level(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = DrainingServer(
            server_config, engine, drain_timeout_s=config.server.drain_timeout_s,
            keep_alive_on_engine_death=config.server.keep_alive_on_engine_death,
        )
        logger.info("serving %s on http://%s:%d (engine core pid %s)", engine.model_name, config.server.host,
                    config.server.port, engine.engine_pid)
        freeze_startup_heap()
        await server.serve()
    finally:
        engine.shutdown()
    if server is not None and server.engine_dead_error is not None:
        raise EngineDeadError(f"{server.engine_dead_error}; the API server exited so that a supervisor can "
                              "restart it (server.keep_alive_on_engine_death keeps it up instead)")


async def _start_engine(async_llm_cls: Any, config: EngineConfig, engine_core: Any = None) -> AsyncLLM:
    kwargs = {} if engine_core is None else {"engine_core": engine_core}
    create = getattr(async_llm_cls, "create", None)
    if create is not None:
        return await create(config, **kwargs)
    engine = async_llm_cls(config, **kwargs)
    start = getattr(engine, "start", None)
    if start is not None:
        await start()
    return engine


def _uvicorn_log_level() -> str:
    level = os.environ.get("PAGEDLLM_LOG_LEVEL", "INFO").lower()
    return level if level in ("critical", "error", "warning", "info", "debug", "trace") else "info"


def run_server(config: EngineConfig, engine_core: Any = None) -> None:
    asyncio.run(serve(config, engine_core))
