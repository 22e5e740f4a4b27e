"""`tool_choice="auto"` with the Hermes parser, driven by a scripted engine:
the serving layer (the real FastAPI app, the real OpenAIServingChat) gets
model text we choose, cut into deltas the way a tokenizer would, so the split
into content and `tool_calls` is checked exactly, streamed and not; every
response validates against the `openai` package's own pydantic types; and
tools, assistant calls and tool answers reach a tool-aware chat template the
way transformers renders them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from pagedllm.entrypoints.openai.api_server import build_app

MODEL_NAME = "scripted"
# A tool-aware ChatML template in the style of Qwen2.5's (Hermes tool format).
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris? And 2 + 3?"}]

TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)
MALFORMED = '<tool_call>{"name": "add", "arguments": {a: 2}}</tool_call> so no call.'
UNKNOWN_TOOL = 'Hm <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
CALL_THEN_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>\nThat is all.'


def _deltas(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class ScriptedEngine:
    """What the API server needs of an AsyncLLM; `generate` plays `script`
    (the text deltas of each choice) and records the prompt it was given."""

    def __init__(self, tokenizer: Any, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.model_name, self.max_model_len, self.vocab_size = MODEL_NAME, 4096, len(tokenizer)
        self.engine_pid, self.ready = None, None
        self.input_processor = self
        self.default_sampling_params: dict[str, Any] = {}
        self.script: list[str] = []
        self.prompts: list[str] = []

    def validate(self, prompt_token_ids: list[int], params: Any, grammar: bool = True) -> int:
        return int(params.max_tokens or 16)

    def truncate(self, prompt_token_ids: list[int], params: Any) -> list[int]:
        return prompt_token_ids

    def shutdown(self) -> None:
        pass

    async def generate(self, token_ids: list[int], params: Any, request_id: str, *, prompt_text: str,
                       output_kind: RequestOutputKind, **_: Any) -> AsyncGenerator[RequestOutput, None]:
        self.prompts.append(prompt_text)
        script = self.script
        if output_kind == RequestOutputKind.FINAL_ONLY:
            script = ["".join(script)]
        for step, delta in enumerate(script):
            last = step == len(script) - 1
            outputs = [CompletionOutput(index, delta, [7], None, None, "stop" if last else None)
                       for index in range(params.n)]
            yield RequestOutput(request_id, prompt_text, token_ids, None, outputs, last)
            await asyncio.sleep(0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    loaded = AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))
    loaded.chat_template = HERMES_TEMPLATE
    return loaded


@pytest.fixture
def engine(tokenizer: Any) -> ScriptedEngine:
    config = EngineConfig.load(server={"tool_call_parser": "hermes", "enable_auto_tool_choice": True})
    return ScriptedEngine(tokenizer, config)


def _post(engine: ScriptedEngine, body: dict[str, Any]) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(engine, engine.config))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body, timeout=60)

    return asyncio.run(post())


def _chat(engine: ScriptedEngine, script: list[str], **fields: Any) -> ChatCompletion:
    engine.script = script
    response = _post(engine, {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, **fields})
    assert response.status_code == 200, response.text
    return ChatCompletion.model_validate(response.json())  # the openai package's own types, validated


def _chat_stream(engine: ScriptedEngine, script: list[str], **fields: Any) -> list[ChatCompletionChunk]:
    engine.script = script
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "stream": True, **fields}
    response = _post(engine, body)
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines[:-1]]


def _rebuild(chunks: list[ChatCompletionChunk], index: int = 0) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) calls and finish reason of one choice."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            content += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.id.startswith("call_") and piece.type == "function"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
    return content, [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], finish_reason


EXPECTED_TWO_CALLS = [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 2, "b": 3}')]


def test_auto_splits_content_and_calls(engine: ScriptedEngine) -> None:
    response = _chat(engine, _deltas(TWO_CALLS, 4))
    choice = response.choices[0]
    assert choice.message.content == "I'll check both.\n"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == EXPECTED_TWO_CALLS
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("delta_size", [1, 3, 7, len(TWO_CALLS)])
def test_auto_streamed_calls_equal_the_whole_and_no_markup_leaks(engine: ScriptedEngine, delta_size: int) -> None:
    chunks = _chat_stream(engine, _deltas(TWO_CALLS, delta_size))
    content, calls, finish_reason = _rebuild(chunks)
    assert (content, calls, finish_reason) == ("I'll check both.\n", EXPECTED_TWO_CALLS, "tool_calls")
    for chunk in chunks:
        for choice in chunk.choices:
            assert "<" not in (choice.delta.content or ""), choice.delta.content


@pytest.mark.parametrize(("text", "content", "calls", "finish_reason"), [
    ("Paris is sunny; 2 + 3 = 5.", "Paris is sunny; 2 + 3 = 5.", [], "stop"),
    (MALFORMED, MALFORMED, [], "stop"),
    (UNKNOWN_TOOL, UNKNOWN_TOOL, [], "stop"),
    (CALL_THEN_TEXT, "\nThat is all.", [("add", '{"a": 1, "b": 1}')], "tool_calls"),
    ("unfinished <tool_call>{\"name\": \"add\"", "unfinished <tool_call>{\"name\": \"add\"", [], "stop"),
], ids=["plain", "malformed-json", "unknown-tool", "text-after-call", "unclosed"])
def test_auto_falls_back_to_content_the_same_streamed_and_not(
    engine: ScriptedEngine, text: str, content: str, calls: list[tuple[str, str]], finish_reason: str
) -> None:
    whole = _chat(engine, _deltas(text, 5)).choices[0]
    assert whole.message.content == content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == calls
    assert whole.finish_reason == finish_reason
    assert _rebuild(_chat_stream(engine, _deltas(text, 2))) == (content, calls, finish_reason)


def test_each_choice_has_its_own_parser(engine: ScriptedEngine) -> None:
    chunks = _chat_stream(engine, _deltas(TWO_CALLS, 3), n=2)
    assert _rebuild(chunks, 0) == _rebuild(chunks, 1) == ("I'll check both.\n", EXPECTED_TWO_CALLS, "tool_calls")
    ids = {piece.id for chunk in chunks for choice in chunk.choices for piece in choice.delta.tool_calls or []}
    assert len(ids - {None}) == 4  # every call of every choice has its own id


def test_tool_choice_none_keeps_markup_as_content(engine: ScriptedEngine) -> None:
    choice = _chat(engine, _deltas(TWO_CALLS, 4), tool_choice="none").choices[0]
    assert choice.message.content == TWO_CALLS and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_openai_client_reads_auto_calls(engine: ScriptedEngine) -> None:
    engine.script = _deltas(TWO_CALLS, 5)

    async def ask() -> tuple[Any, list[Any]]:
        transport = httpx.ASGITransport(app=build_app(engine, engine.config))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http_client:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http_client)
            whole = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS)
            stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                          stream=True)
            return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(ask())
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    assert _rebuild(chunks)[1] == EXPECTED_TWO_CALLS


def test_tools_and_tool_messages_render_as_transformers_does(engine: ScriptedEngine, tokenizer: Any) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "5"},
    ]
    engine.script = ["Sunny, and 5."]
    response = _post(engine, {"model": MODEL_NAME, "messages": messages, "tools": TOOLS})
    assert response.status_code == 200, response.text
    # transformers reads the arguments as a dict (vLLM passes them so too).
    for_hf = json.loads(json.dumps(messages))
    for call in for_hf[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = tokenizer.apply_chat_template(for_hf, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert engine.prompts == [expected]
    assert '<tool_response id="call_b">5</tool_response>' in expected and '"name": "add"' in expected


def test_auto_tool_choice_needs_a_known_parser(tokenizer: Any) -> None:
    without_parser = EngineConfig.load(server={"enable_auto_tool_choice": True})
    with pytest.raises(ConfigError, match="tool-call-parser") as caught:
        build_app(ScriptedEngine(tokenizer, without_parser), without_parser)  # type: ignore[arg-type]
    assert "hermes" in str(caught.value)
    unknown = EngineConfig.load(server={"enable_auto_tool_choice": True, "tool_call_parser": "nope"})
    with pytest.raises(ConfigError, match="hermes") as caught:
        build_app(ScriptedEngine(tokenizer, unknown), unknown)  # type: ignore[arg-type]
    assert caught.value.key == "server.tool_call_parser"


def test_reasoning_is_split_off_before_tool_calls_are_read(tokenizer: Any) -> None:
    # As vLLM: the reasoning parser takes its section first, the tool parser reads the content.
    config = EngineConfig.load(server={"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
                               structured_output={"reasoning_parser": "think"})
    engine = ScriptedEngine(tokenizer, config)
    reply = "<think>The user wants <tool_call> use.</think>Sure.\n" + TWO_CALLS.split("\n", 1)[1]
    engine.script = _deltas(reply, 4)
    whole = _post(engine, {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS})
    choice = ChatCompletion.model_validate(whole.json()).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "The user wants <tool_call> use."
    assert choice.message.content == "Sure.\n"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == EXPECTED_TWO_CALLS
    assert choice.finish_reason == "tool_calls"
    for size in (1, 3):
        engine.script = _deltas(reply, size)
        chunks = _chat_stream(engine, engine.script)
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                            for c in chunks if c.choices)
        assert reasoning == "The user wants <tool_call> use."
        assert _rebuild(chunks) == ("Sure.\n", EXPECTED_TWO_CALLS, "tool_calls")
