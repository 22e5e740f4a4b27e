"""Function calling on the shipped tiny model (pagedllm-tiny, which was never
taught to call tools) through a real `pagedllm serve` and the `openai` client:
`tool_choice="required"` and a named function are forced by the grammar
backend, so every response, streamed or not, parses into `tool_calls` whose
arguments validate against the tool's own schema. Bad tool input is a 400
naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from helpers.server import ServerProcess, start_server

MAX_TOKENS = 1000
SEEDS = (1, 2, 3, 4)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]

# Bounded schemas (maxLength, min/max, enums, no extra keys): a finite
# language, so even a random walk through the grammar ends within MAX_TOKENS.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -99, "maximum": 99},
    "b": {"type": "integer", "minimum": -99, "maximum": 99},
}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(None, "--num-kv-blocks", "256") as srv:  # no MODEL: the shipped pagedllm-tiny
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls: list[tuple[str, str, str]], allowed: set[str], parallel: bool) -> None:
    """Each (id, name, arguments) names an offered tool and its arguments
    validate against that tool's schema."""
    assert calls, "no tool call"
    if not parallel:
        assert len(calls) == 1
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and len(call_id) > len("call_")
        assert name in allowed
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, str, str]], str, str | None]:
    """Calls rebuilt from the deltas the way the OpenAI docs do (by index), the
    streamed content, and the finish reason."""
    calls: dict[int, list[str]] = {}
    content, finish_reason = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                # The first piece of a call: its id, type and name, before any argument.
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.id, piece.function.name, ""]
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index][2] += piece.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [(c[0], c[1], c[2]) for _, c in sorted(calls.items())], content, finish_reason


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", True),
    ("required", False),
    ({"type": "function", "function": {"name": "add"}}, True),
    ({"type": "function", "function": {"name": "get_weather"}}, False),
], ids=["required-parallel", "required-single", "named-add", "named-weather"])
def test_forced_tool_calls_always_parse_into_valid_calls(
    client: openai.OpenAI, model: str, tool_choice: Any, parallel: bool
) -> None:
    allowed = {tool_choice["function"]["name"]} if isinstance(tool_choice, dict) else set(SCHEMAS)
    for seed in SEEDS:
        request = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                       parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        response = client.chat.completions.create(**request)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        _check_calls(calls, allowed, parallel)

        streamed, content, finish_reason = _streamed_calls(list(client.chat.completions.create(**request,
                                                                                                stream=True)))
        assert finish_reason == "tool_calls" and content == ""
        _check_calls(streamed, allowed, parallel)
        # Same seed, same tokens: the same calls (ids are fresh per response).
        assert [call[1:] for call in streamed] == [call[1:] for call in calls]


def test_tool_choice_none_answers_in_text_and_tool_messages_render(client: openai.OpenAI, model: str) -> None:
    # A whole tool round trip: the assistant's call and the tool's answer go
    # back through the chat template.
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    response = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert response.usage.completion_tokens >= 1


def test_auto_with_the_parser_flags_returns_the_models_text(model: str) -> None:
    # pagedllm-tiny writes Python, never <tool_call>: under "auto" the answer
    # is exactly its "none" answer (greedy), whole and streamed.
    flags = ("--num-kv-blocks", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with start_server(None, *flags) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        request = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0)
        plain = client.chat.completions.create(**request, tool_choice="none").choices[0]
        auto = client.chat.completions.create(**request, tool_choice="auto").choices[0]
        assert "<tool_call>" not in (plain.message.content or "")
        assert (auto.message.content, auto.message.tool_calls) == (plain.message.content, None)
        assert auto.finish_reason == plain.finish_reason
        streamed, content, finish_reason = _streamed_calls(list(client.chat.completions.create(**request,
                                                                                                stream=True)))
        assert (streamed, content, finish_reason) == ([], plain.message.content, plain.finish_reason)


def test_auto_tool_choice_without_a_parser_stops_the_server_at_start() -> None:
    with pytest.raises(RuntimeError, match="only together with --tool-call-parser NAME"):
        with start_server(None, "--enable-auto-tool-choice"):
            pass


def _body(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, **fields}


NESTED = {"type": "object", "properties": {"x": {}}}
for _ in range(40):
    NESTED = {"type": "object", "properties": {"x": NESTED}}

# (id, body, param of the 400, words the message holds)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    ("auto-without-parser", _body(tool_choice="auto"), "tool_choice", ("--enable-auto-tool-choice",
                                                                       "--tool-call-parser")),
    ("tools-default-to-auto", _body(), "tool_choice", ("--enable-auto-tool-choice",)),
    ("choice-without-tools", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice", ("tools",)),
    ("choice-unknown-word", _body(tool_choice="always"), "tool_choice", ()),
    ("named-unknown-function", _body(tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", ("get_weather", "add")),
    ("too-many-tools", _body(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
                             tool_choice="required"), "tools", ("128",)),
    ("bad-tool-name", _body(tools=[{"type": "function", "function": {"name": "has space"}}], tool_choice="none"),
     "tools.0.function.name", ("pattern",)),
    ("long-tool-name", _body(tools=[{"type": "function", "function": {"name": "f" * 65}}], tool_choice="none"),
     "tools.0.function.name", ()),
    ("duplicate-tool-names", _body(tools=[TOOLS[0], TOOLS[0]], tool_choice="required"), "tools.1.function.name",
     ("unique",)),
    ("tool-type-not-function", _body(tools=[{"type": "code", "function": TOOLS[0]["function"]}],
                                     tool_choice="none"), "tools.0.type", ()),
    ("parameters-not-object", _body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}], tool_choice="required"),
     "tools.0.function.parameters.type", ("object",)),
    ("schema-too-deep", _body(tools=[{"type": "function", "function": {"name": "f", "parameters": NESTED}}],
                              tool_choice="required"), "tools.0.function.parameters", ("32",)),
    ("schema-too-large", _body(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "description": "x" * 60_000}}} for i in range(5)], tool_choice="none"),
     "tools.4.function.parameters", ("characters",)),
    ("schema-grammar-refuses", _body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}], tool_choice="required"), "tools", ("wat",)),
    ("with-response-format", _body(tool_choice="required", response_format={"type": "json_object"}),
     "response_format", ("tool_choice",)),
    ("tool-message-without-id", _body(tool_choice="none", messages=[*MESSAGES, {"role": "tool", "content": "5"}]),
     "messages.1.tool_call_id", ("call",)),
    ("user-message-with-calls", _body(tool_choice="none", messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]),
     "messages.0.tool_calls", ("assistant",)),
    ("call-arguments-not-json", _body(tool_choice="none", messages=[*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}]),
     "messages.1.tool_calls.0.function.arguments", ("JSON",)),
    ("parallel-not-bool", _body(tool_choice="none", parallel_tool_calls="yes"), "parallel_tool_calls", ()),
    ("functions-still-refused", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions",
     ("not supported",)),
]


@pytest.mark.parametrize(("body", "param", "words"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_tool_requests_are_400s_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    # The server still serves.
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
