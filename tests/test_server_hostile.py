"""Hostile requests against the real server, across every route: integers past
64 bits in every integer field, lone surrogates in every string field, NaN and
infinities, nested and oversized schemas, costly regexes and grammars, huge
stop lists, request-side chat templates, unimplemented fields. Each is a 4xx
with an OpenAI-shaped body naming the field, and the server answers a normal
request right after it (nothing crashed, nothing is stuck)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

API_KEY = "hostile-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}
MODEL_NAME = "tiny-hostile"
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 1 << 20
MAX_PENDING = 64
HUGE = 2**64  # past int64 and uint64: what msgpack and tensors cannot hold
HUGE_NEGATIVE = -(2**64)
SURROGATE = "\ud800"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    model_dir = cached_tiny_model("llama", with_tokenizer=True, seed=31, max_position_embeddings=MAX_MODEL_LEN)
    with start_server(
        model_dir, "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name",
        MODEL_NAME, "--max-body-bytes", str(MAX_BODY_BYTES), "--max-pending-requests", str(MAX_PENDING),
        "--compile-timeout-s", "2", api_key=API_KEY,
    ) as srv:
        yield srv


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_schema_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def wide_schema(num_properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{i:06d}": {"type": "integer"} for i in range(num_properties)}}


def so(**spec: Any) -> dict[str, Any]:
    return completion(structured_outputs=spec)


# (id, method, path, body (dict, or raw bytes), status, param, words the message must hold)
Row = tuple[str, str, str, Any, int, "str | None", tuple[str, ...]]
HOSTILE: list[Row] = [
    # --- integers past 64 bits, in every integer field that reaches the engine
    *[(f"cmpl-{field}-huge", "POST", CMPL, completion(**{field: HUGE}), 400, field, ())
      for field in ("n", "max_tokens", "seed", "priority", "top_k", "min_tokens", "logprobs", "prompt_logprobs",
                    "best_of")],
    *[(f"cmpl-{field}-huge-negative", "POST", CMPL, completion(**{field: HUGE_NEGATIVE}), 400, field, ())
      for field in ("seed", "priority", "top_k")],
    ("cmpl-stop-token-id-huge", "POST", CMPL, completion(stop_token_ids=[HUGE]), 400, "stop_token_ids", ()),
    ("cmpl-stop-token-id-past-vocab", "POST", CMPL, completion(stop_token_ids=[10**9]), 400, "stop_token_ids", ()),
    ("cmpl-prompt-token-huge", "POST", CMPL, completion(prompt=[1, HUGE]), 400, "prompt", ()),
    ("cmpl-prompt-batch-token-huge", "POST", CMPL, completion(prompt=[[1], [HUGE]]), 400, "prompt", ()),
    ("cmpl-logit-bias-key-huge", "POST", CMPL, completion(logit_bias={str(HUGE): 1}), 400, "logit_bias", ()),
    ("cmpl-logit-bias-key-not-int", "POST", CMPL, completion(logit_bias={"abc": 1}), 400, "logit_bias", ()),
    ("cmpl-logit-bias-value-huge", "POST", CMPL, completion(logit_bias={"1": HUGE}), 400, "logit_bias", ()),
    *[(f"chat-{field}-huge", "POST", CHAT, chat(**{field: HUGE}), 400, field, ())
      for field in ("n", "max_tokens", "max_completion_tokens", "seed", "priority", "top_k", "min_tokens")],
    ("chat-top-logprobs-huge", "POST", CHAT, chat(logprobs=True, top_logprobs=HUGE), 400, "top_logprobs", ()),
    ("chat-stop-token-id-huge", "POST", CHAT, chat(stop_token_ids=[HUGE]), 400, "stop_token_ids", ()),
    ("chat-logit-bias-key-huge", "POST", CHAT, chat(logit_bias={str(HUGE): 1}), 400, "logit_bias", ()),
    ("detokenize-token-huge", "POST", "/detokenize", {"tokens": [HUGE]}, 400, "tokens", ()),
    ("so-max-whitespace-huge", "POST", CMPL, so(json_object=True, max_whitespace=HUGE), 400,
     "structured_outputs", ()),
    # --- NaN and infinities (Python's json parser accepts them)
    ("cmpl-temperature-nan", "POST", CMPL, b'{"prompt": "a", "temperature": NaN}', 400, "temperature", ()),
    ("cmpl-top-p-infinity", "POST", CMPL, b'{"prompt": "a", "top_p": Infinity}', 400, "top_p", ()),
    ("chat-presence-penalty-minus-infinity", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "a"}], "presence_penalty": -Infinity}', 400, "presence_penalty", ()),
    ("cmpl-logit-bias-nan", "POST", CMPL, b'{"prompt": "a", "logit_bias": {"1": NaN}}', 400, "logit_bias", ()),
    # --- lone surrogates in every string field
    *[(f"cmpl-{field}-surrogate", "POST", CMPL, completion(**{field: value}), 400, field, ("surrogate",))
      for field, value in (("prompt", f"a{SURROGATE}"), ("stop", SURROGATE), ("model", SURROGATE),
                           ("user", SURROGATE), ("cache_salt", SURROGATE))],
    ("cmpl-prompt-list-surrogate", "POST", CMPL, completion(prompt=["ok", SURROGATE]), 400, "prompt",
     ("surrogate",)),
    ("cmpl-stop-list-surrogate", "POST", CMPL, completion(stop=["ok", SURROGATE]), 400, "stop", ("surrogate",)),
    ("so-regex-surrogate", "POST", CMPL, so(regex=SURROGATE), 400, "structured_outputs", ("surrogate",)),
    ("so-choice-surrogate", "POST", CMPL, so(choice=["a", SURROGATE]), 400, "structured_outputs", ("surrogate",)),
    ("so-json-key-surrogate", "POST", CMPL, so(json={"type": "object", "properties": {SURROGATE: {}}}), 400,
     "structured_outputs", ("surrogate",)),
    ("chat-content-surrogate", "POST", CHAT, chat(messages=[{"role": "user", "content": SURROGATE}]), 400,
     "messages", ("surrogate",)),
    ("chat-content-part-surrogate", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]), 400, "messages",
     ("surrogate",)),
    ("chat-name-surrogate", "POST", CHAT, chat(messages=[{"role": "user", "content": "a", "name": SURROGATE}]),
     400, "messages", ("surrogate",)),
    ("chat-response-format-name-surrogate", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": SURROGATE, "schema": {}}}), 400,
     "response_format", ("surrogate",)),
    ("tokenize-prompt-surrogate", "POST", "/tokenize", {"prompt": SURROGATE}, 400, "prompt", ("surrogate",)),
    ("tokenize-messages-surrogate", "POST", "/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]},
     400, "messages", ("surrogate",)),
    ("detokenize-model-surrogate", "POST", "/detokenize", {"model": SURROGATE, "tokens": [1]}, 400, "model",
     ("surrogate",)),
    # --- nested and oversized schemas, costly regexes and grammars
    ("so-json-nested-400", "POST", CMPL, so(json=nested_schema(400)), 400, "structured_outputs.json",
     ("depth",)),
    ("so-json-text-nested-10000", "POST", CMPL, so(json=nested_schema_text(10_000)), 400,
     "structured_outputs.json", ("depth",)),
    ("response-format-nested-400", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(400)}}),
     400, "response_format.json_schema.schema", ("depth",)),
    ("so-json-oversized", "POST", CMPL, so(json=wide_schema(20_000)), 400, "structured_outputs.json",
     ("structured_output.",)),
    # Parses in 0.1 s, compiles for about 26 s: stopped at the server's compile_timeout_s.
    ("so-regex-costly", "POST", CMPL, so(regex="(a|b|c|d|e|f|g|h)" * 4000), 400, "structured_outputs.regex",
     ("structured_output.compile_timeout_s",)),
    ("so-regex-oversized", "POST", CMPL, so(regex="a" * 600_000), 400, "structured_outputs.regex",
     ("structured_output.",)),
    ("so-grammar-oversized", "POST", CMPL, so(grammar="root ::= " + " | ".join(f'"w{i}"' for i in range(60_000))),
     400, "structured_outputs.grammar", ("structured_output.",)),
    ("so-grammar-invalid", "POST", CMPL, so(grammar="root ::= (((("), 400, "structured_outputs.grammar", ()),
    ("so-choice-huge", "POST", CMPL, so(choice=[f"c{i}" for i in range(100_000)]), 400,
     "structured_outputs.choice", ("structured_output.",)),
    ("body-nested-arrays", "POST", CMPL, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "body",
     ()),
    # --- huge stop lists
    ("cmpl-stop-list-huge", "POST", CMPL, completion(stop=[f"s{i}" for i in range(50_000)]), 400, "stop", ()),
    ("cmpl-stop-string-huge", "POST", CMPL, completion(stop=["x" * 200_000]), 400, "stop", ()),
    ("cmpl-stop-token-ids-huge-list", "POST", CMPL, completion(stop_token_ids=list(range(8192)) * 8), 400,
     "stop_token_ids", ()),
    # --- request-side chat templates (the server does not trust them)
    ("chat-template", "POST", CHAT, chat(chat_template="{% for i in range(10**9) %}x{% endfor %}"), 400,
     "chat_template", ("trust",)),
    ("chat-template-kwargs", "POST", CHAT, chat(chat_template_kwargs={"x": 1}), 400, "chat_template_kwargs",
     ("trust",)),
    # --- fields not implemented yet are refused, not ignored
    *[(f"chat-{field}", "POST", CHAT, chat(**{field: value}), 400, field, ("not supported",))
      for field, value in (("functions", [{"name": "f"}]), ("audio", {}),
                           ("modalities", ["audio"]), ("prediction", {"type": "content", "content": "x"}),
                           ("web_search_options", {}))],
    # --- tools: "auto" needs a parser this server lacks; hostile tool lists (more: test_tool_calls_server.py)
    ("chat-tools-auto-without-parser", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     400, "tool_choice", ("--enable-auto-tool-choice",)),
    ("chat-tools-too-many", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}}
                                                      for i in range(10_000)]), 400, "tools", ("128",)),
    ("chat-tool-choice-without-tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice", ("tools",)),
    ("chat-image-part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content", ("image_url",)),
    ("cmpl-best-of", "POST", CMPL, completion(best_of=3), 400, "best_of", ()),
    # --- admission: one request above the pending limit by itself
    ("cmpl-prompts-times-n-above-pending", "POST", CMPL, completion(prompt=["a", "b", "c"], n=MAX_PENDING // 2),
     400, "n", ("max_pending_requests",)),
    # --- every other route, wrong method and auth abuse
    *[(f"post-{path.strip('/').replace('/', '-')}", "POST", path, {}, 405, None, ())
      for path in ("/v1/models", "/version", "/metrics", "/server_info", "/health")],
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "words"),
    [row[1:] for row in HOSTILE],
    ids=[row[0] for row in HOSTILE],
)
def test_hostile_request_is_a_4xx_naming_the_field_and_the_server_still_serves(
    server: ServerProcess, method: str, path: str, body: Any, status: int, param: str | None,
    words: tuple[str, ...],
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.request(method, f"{server.base_url}{path}", content=content,
                             headers={**KEY, "Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text[:2000]
    error = response.json()["error"]
    assert error["code"] == status, error
    # The param names the field, or an element of it (`stop_token_ids.0`).
    assert error["param"] == param or (param is not None and error["param"].startswith(f"{param}.")), error
    assert error["type"] and error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"], error["message"][:2000]
    for word in words:
        assert word in error["message"], error["message"][:2000]
    if status == 405:
        assert response.headers["allow"]
    normal = httpx.post(f"{server.base_url}{CMPL}", json=completion(max_tokens=1), headers=KEY, timeout=60)
    assert normal.status_code == 200, normal.text
    assert normal.json()["usage"]["completion_tokens"] == 1


def test_the_hostile_table_covers_every_route_and_kind() -> None:
    assert len(HOSTILE) >= 60
    routes = {row[2] for row in HOSTILE}
    assert {CMPL, CHAT, "/tokenize", "/detokenize", "/v1/models", "/version", "/metrics", "/server_info",
            "/health"} <= routes


def test_two_authorization_headers_are_refused_and_the_scheme_is_case_insensitive(server: ServerProcess) -> None:
    url = f"{server.base_url}/version"
    twice = httpx.get(url, headers=[("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other")])
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "authorization"
    assert httpx.get(url, headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"BEARER {API_KEY}"}).status_code == 200


def test_no_response_names_a_path_on_the_server_host(server: ServerProcess, tmp_path: Path) -> None:
    models = httpx.get(f"{server.base_url}/v1/models", headers=KEY).json()
    assert models["data"][0]["root"] == MODEL_NAME
    assert "/" not in json.dumps(models["data"][0]["root"])
