"""Bad input, auth, limits and overload against the real server: each answer
has the right status and an OpenAI-shaped error naming the field."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import EngineConfig
from pagedllm.entrypoints.openai.api_server import build_app

API_KEY = "secret-key"
MODEL_NAME = "tiny-errors"
# Long enough that the overload test's streams cannot finish while it runs.
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 8192
MAX_PENDING_REQUESTS = 4
KEY = {"Authorization": f"Bearer {API_KEY}"}

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestEntityTooLarge", 503: "ServiceUnavailableError"}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=12, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(
        model_dir, "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME,
        "--max-body-bytes", str(MAX_BODY_BYTES), "--max-pending-requests", str(MAX_PENDING_REQUESTS),
        api_key=API_KEY,
    ) as srv:
        yield srv


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"

# (id, path, body: dict, or raw bytes, auth headers, status, param, words the message must hold)
MALFORMED: list[tuple[str, str, Any, dict[str, str], int, str | None, tuple[str, ...]]] = [
    ("not-json", CMPL, b"{not json", KEY, 400, "body", ("JSON",)),
    ("invalid-utf8", CMPL, b'{"prompt": "\xff\xfe", "max_tokens": 1}', KEY, 400, "body", ("JSON",)),
    ("json-array-body", CMPL, b"[1, 2]", KEY, 400, "body", ()),
    ("missing-prompt", CMPL, {"model": MODEL_NAME}, KEY, 400, "prompt", ("required",)),
    ("prompt-number", CMPL, completion(prompt=5), KEY, 400, "prompt", ("string",)),
    ("prompt-mixed-list", CMPL, completion(prompt=[1, "a"]), KEY, 400, "prompt", ("token ids",)),
    ("prompt-empty-list", CMPL, completion(prompt=[]), KEY, 400, "prompt", ("non-empty",)),
    ("prompt-empty-string", CMPL, completion(prompt=""), KEY, 400, "prompt", ("non-empty",)),
    ("prompt-too-long", CMPL, completion(prompt=[7] * MAX_MODEL_LEN), KEY, 400, "prompt",
     (str(MAX_MODEL_LEN), "max_model_len")),
    ("token-id-outside-vocab", CMPL, completion(prompt=[1, 10**6]), KEY, 400, "prompt", ("8192",)),
    ("max-tokens-string", CMPL, completion(max_tokens="ten"), KEY, 400, "max_tokens", ("integer",)),
    ("max-tokens-float", CMPL, completion(max_tokens=2.5), KEY, 400, "max_tokens", ("integer",)),
    ("max-tokens-zero", CMPL, completion(max_tokens=0), KEY, 400, "max_tokens", (">= 1",)),
    ("max-tokens-negative", CMPL, completion(max_tokens=-3), KEY, 400, "max_tokens", (">= 1",)),
    ("max-tokens-beyond-context", CMPL, completion(max_tokens=10**6), KEY, 400, "max_tokens",
     (str(MAX_MODEL_LEN), "context left")),
    ("temperature-negative", CMPL, completion(temperature=-0.5), KEY, 400, "temperature", (">= 0",)),
    ("temperature-string", CMPL, completion(temperature="hot"), KEY, 400, "temperature", ("number",)),
    ("top-p-above-1", CMPL, completion(top_p=1.5), KEY, 400, "top_p", ("(0, 1]",)),
    ("top-p-zero", CMPL, completion(top_p=0), KEY, 400, "top_p", ("(0, 1]",)),
    ("top-k-negative", CMPL, completion(top_k=-5), KEY, 400, "top_k", ("-1",)),
    ("min-p-above-1", CMPL, completion(min_p=2.0), KEY, 400, "min_p", ("[0, 1]",)),
    ("presence-penalty-3", CMPL, completion(presence_penalty=3), KEY, 400, "presence_penalty", ("[-2, 2]",)),
    ("repetition-penalty-0", CMPL, completion(repetition_penalty=0), KEY, 400, "repetition_penalty", ("> 0",)),
    ("logprobs-21", CMPL, completion(logprobs=21), KEY, 400, "logprobs", ("20",)),
    ("n-zero", CMPL, completion(n=0), KEY, 400, "n", (">= 1",)),
    ("n-huge", CMPL, completion(n=10**6), KEY, 400, "n", ("128",)),
    ("n-string", CMPL, completion(n="2"), KEY, 400, "n", ("integer",)),
    ("min-tokens-above-max", CMPL, completion(min_tokens=5, max_tokens=2), KEY, 400, "min_tokens", ("max_tokens",)),
    ("stop-number", CMPL, completion(stop=5), KEY, 400, "stop", ("string",)),
    ("stop-token-ids-strings", CMPL, completion(stop_token_ids=["a"]), KEY, 400, "stop_token_ids.0",
     ("integer",)),
    ("seed-string", CMPL, completion(seed="x"), KEY, 400, "seed", ("integer",)),
    ("stream-not-bool", CMPL, completion(stream="yes"), KEY, 400, "stream", ("boolean",)),
    ("stream-options-without-stream", CMPL, completion(stream_options={"include_usage": True}), KEY, 400,
     "stream_options", ("stream",)),
    ("priority-string", CMPL, completion(priority="high"), KEY, 400, "priority", ("integer",)),
    ("cache-salt-number", CMPL, completion(cache_salt=5), KEY, 400, "cache_salt", ("string",)),
    ("suffix", CMPL, completion(suffix="x"), KEY, 400, "suffix", ("not supported",)),
    ("unknown-model", CMPL, completion(model="gpt-17"), KEY, 404, "model", ("gpt-17",)),
    ("chat-empty-messages", CHAT, chat(messages=[]), KEY, 400, "messages", ("at least one",)),
    ("chat-missing-messages", CHAT, {"model": MODEL_NAME}, KEY, 400, "messages", ("required",)),
    ("chat-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), KEY, 400, "messages.0.role",
     ("user",)),
    ("chat-content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), KEY, 400,
     "messages.0.content", ("string",)),
    ("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), KEY, 400, "top_logprobs", ("20",)),
    ("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), KEY, 400, "top_logprobs", ("logprobs",)),
    ("chat-max-completion-tokens-beyond-context", CHAT, chat(max_completion_tokens=10**6), KEY, 400,
     "max_completion_tokens", ("context left",)),
    ("chat-unknown-model", CHAT, chat(model="nope"), KEY, 404, "model", ("nope",)),
    ("chat-stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), KEY, 400,
     "stream_options", ("stream",)),
    ("tokenize-nothing", "/tokenize", {"model": MODEL_NAME}, KEY, 400, "prompt", ("messages",)),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [10**6]}, KEY, 400, "tokens", ("8192",)),
    ("missing-key", CMPL, completion(), {}, 401, "authorization", ("API key",)),
    ("wrong-key", CMPL, completion(), {"Authorization": "Bearer wrong"}, 401, "authorization", ("API key",)),
    ("key-without-bearer", CMPL, completion(), {"Authorization": API_KEY}, 401, "authorization", ("Bearer",)),
    ("oversized-body", CMPL, completion(prompt="x" * MAX_BODY_BYTES), KEY, 413, "body", (str(MAX_BODY_BYTES),)),
    ("unknown-route", "/v1/nothing-here", completion(), KEY, 404, None, ("Not Found",)),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param", "words"),
    [row[1:] for row in MALFORMED],
    ids=[row[0] for row in MALFORMED],
)
def test_malformed_request_is_refused_naming_the_field(
    server: ServerProcess, path: str, body: Any, headers: dict[str, str], status: int, param: str | None,
    words: tuple[str, ...],
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.base_url}{path}", content=content,
                          headers={**headers, "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (ERROR_TYPES[status], param, status)
    if param is not None:
        assert param.split(".")[0] in error["message"], error["message"]
    for word in words:
        assert word in error["message"], error["message"]


def test_valid_request_succeeds_after_the_malformed_ones(server: ServerProcess) -> None:
    response = httpx.post(f"{server.base_url}{CMPL}", json=completion(max_tokens=3), headers=KEY, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_error_table_is_large_enough() -> None:
    assert len(MALFORMED) >= 25


def test_wrong_method_is_405(server: ServerProcess) -> None:
    response = httpx.get(f"{server.base_url}{CMPL}", headers=KEY)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == 405


# ------------------------------------------------------------------- auth


def _stub_engine() -> Any:
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    return SimpleNamespace(
        tokenizer=AutoTokenizer.from_pretrained(str(get_tokenizer_dir())), model_name=MODEL_NAME,
        max_model_len=MAX_MODEL_LEN, vocab_size=8192, engine_pid=None, shutdown=lambda: None,
        ready=SimpleNamespace(model_path="stub"),
        stat_logger=SimpleNamespace(render=lambda: b"# metrics\n"),
    )


def registered_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app registers (built like the server's)."""
    app = build_app(_stub_engine(), EngineConfig.load(server={"api_key": API_KEY}))
    routes = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                routes.append((method, route.path))  # type: ignore[attr-defined]
    return routes


def test_every_route_but_health_needs_the_key(server: ServerProcess) -> None:
    routes = registered_routes()
    paths = {path for _, path in routes}
    # The enumeration really sees the app (a new route would show up here too).
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/version", "/tokenize",
            "/detokenize", "/health", "/openapi.json"} <= paths
    # No CDN-backed documentation pages (blank offline, third-party scripts).
    assert not {"/docs", "/redoc"} & paths
    for method, path in routes:
        response = httpx.request(method, f"{server.base_url}{path}", json={}, timeout=30)
        if path == "/health":
            assert response.status_code == 200
        else:
            assert response.status_code == 401, (method, path, response.status_code)
            assert response.json()["error"]["type"] == "AuthenticationError"
        with_key = httpx.request(method, f"{server.base_url}{path}", json={}, headers=KEY, timeout=30)
        assert with_key.status_code != 401, (method, path)


def test_metrics_can_be_opened_without_the_key_by_config() -> None:
    import asyncio

    async def get(config: EngineConfig, path: str) -> int:
        transport = httpx.ASGITransport(app=build_app(_stub_engine(), config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get(path)).status_code

    opened = EngineConfig.load(server={"api_key": API_KEY, "allow_unauthenticated_metrics": True})
    closed = EngineConfig.load(server={"api_key": API_KEY})
    assert asyncio.run(get(opened, "/metrics")) == 200
    assert asyncio.run(get(opened, "/version")) == 401
    assert asyncio.run(get(closed, "/metrics")) == 401


# --------------------------------------------------------------- overload


def test_requests_beyond_max_pending_get_503_then_service_resumes(server: ServerProcess) -> None:
    url = f"{server.base_url}{CMPL}"
    body = completion(prompt="go", max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True, stream=True)
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as streams:
        for _ in range(MAX_PENDING_REQUESTS):
            stream = streams.enter_context(client.stream("POST", url, json=body, headers=KEY))
            assert stream.status_code == 200
        response = httpx.post(url, json=completion(), headers=KEY, timeout=30)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert "max_pending_requests" in error["message"] and str(MAX_PENDING_REQUESTS) in error["message"]
    # The dropped streams are aborted; new requests are admitted again.
    deadline = time.monotonic() + 60  # a hang guard only
    while True:
        response = httpx.post(url, json=completion(), headers=KEY, timeout=30)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.status_code == 200, response.text


# ------------------------------------------------------------ internal errors


def test_an_unexpected_error_is_a_500_without_its_text_in_json_and_in_a_stream() -> None:
    import asyncio

    from pagedllm.entrypoints.openai.serving_engine import stream_error_chunk

    secret = "/srv/models/secret-folder/model.safetensors"

    class FailingEngine(SimpleNamespace):
        failing = False

        @property
        def max_model_len(self) -> int:
            if self.failing:
                raise RuntimeError(f"cannot read {secret}")
            return MAX_MODEL_LEN

    engine = FailingEngine(**{k: v for k, v in vars(_stub_engine()).items() if k != "max_model_len"})
    app = build_app(engine, EngineConfig.load())  # type: ignore[arg-type]
    engine.failing = True  # /v1/models reads it per request

    async def get_models() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/v1/models")

    response = asyncio.run(get_models())
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert "error id" in error["message"] and secret not in response.text and "RuntimeError" not in response.text
    chunk = stream_error_chunk(RuntimeError(f"cannot read {secret}"))
    assert chunk.startswith("data: ") and "error id" in chunk and secret not in chunk
