"""`tool_choice="auto"` end to end: a real `pagedllm serve --enable-auto-tool-choice
--tool-call-parser hermes` over the test plugin's scripted model (its next
tokens come from config.json), so the engine, the incremental detokenizer and
the parser see a model that really writes Hermes tool calls, cut into tokens
(a tag alone, a call body alone, a whole block in one token). Through the
`openai` client, streamed and not: the content and the calls split exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers.scripted_model import build_scripted_model, chain_script, scripted_tokenizer
from helpers.server import ServerProcess, start_server

MODEL_NAME = "scripted-tool-caller"
CONTENT = "Checking both."
BODY_A = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
BLOCK_B = '\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
# Added tokens (plain text, not special), so the script can name each piece by one id.
ADDED = ["<tool_call>", "</tool_call>", BODY_A, BLOCK_B]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris? And 2 + 3?"}]
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("scripted-tools")
    tokenizer = scripted_tokenizer(root / "tokenizer", ADDED)
    reply = tokenizer.encode(CONTENT, add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids(token) for token in ["<tool_call>", BODY_A, "</tool_call>", BLOCK_B]]
    assert tokenizer.decode(reply) == CONTENT + "<tool_call>" + BODY_A + "</tool_call>" + BLOCK_B
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model_dir: Path = build_scripted_model(root / "model", ADDED, chain_script(reply, stop), default=[reply[0]])
    flags = ("--num-kv-blocks", "64", "--max-model-len", "256", "--served-model-name", MODEL_NAME,
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with start_server(model_dir, *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_auto_tool_calls_from_a_model_that_writes_them(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0)
    choice = response.choices[0]
    assert choice.message.content == CONTENT
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == EXPECTED_CALLS
    assert choice.finish_reason == "tool_calls"
    # "none": the same tokens, all of it content.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                                           tool_choice="none").choices[0]
    assert plain.message.content == CONTENT + "<tool_call>" + BODY_A + "</tool_call>" + BLOCK_B
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"


def test_auto_tool_calls_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                                                 stream=True))
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert "<" not in (delta.content or "")  # no markup ever reaches content
        content += delta.content or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    assert content == CONTENT and finish_reason == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))] == EXPECTED_CALLS
