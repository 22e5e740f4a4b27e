"""Structured output over HTTP with the real `openai` client: response_format
json_schema (streamed and not) and json_object, vLLM's structured_outputs body
field, and 400s naming a bad schema or grammar while the server keeps serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers.json_prefix import is_json_prefix
from helpers.json_schemas import MAX_TOKENS, SCHEMAS
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

MODEL_NAME = "tiny-structured"
SCHEMA = SCHEMAS["array_of_objects"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    model_dir: Path = cached_tiny_model("llama", with_tokenizer=True, seed=5)
    # Whitespace-free JSON for every request (response_format has no such knob)
    # keeps the random model's language finite (see helpers.json_schemas).
    env = {"PAGEDLLM_STRUCTURED_OUTPUT__DISABLE_ANY_WHITESPACE": "true"}
    with start_server(model_dir, "--num-kv-blocks", "128", "--served-model-name", MODEL_NAME, env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "items", "schema": schema, "strict": True}}


def _nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema




def test_chat_response_format_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "List some items as JSON."}]
    for seed in (1, 2):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format=_response_format(SCHEMA),
        )
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].message.content), SCHEMA)
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format=_response_format(SCHEMA), stream=True,
        ))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == response.choices[0].message.content  # same seed, same tokens
        jsonschema.validate(json.loads(streamed), SCHEMA)


def test_completions_response_format_and_structured_outputs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": _response_format(SCHEMAS["ref_defs"])},
    )
    jsonschema.validate(json.loads(response.choices[0].text), SCHEMAS["ref_defs"])
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="id:", max_tokens=40, temperature=1.0, seed=3, stream=True,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}},
    ))
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", "".join(c.choices[0].text for c in chunks if c.choices))
    choice = client.completions.create(
        model=MODEL_NAME, prompt="?", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert choice.choices[0].text in ("left", "right")
    guided = client.completions.create(
        model=MODEL_NAME, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMAS["one_of_tagged"], "disable_any_whitespace": True,
                                           "backend": "guidance"}},
    )
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMAS["one_of_tagged"])


def test_guided_aliases_constrain_the_output_on_both_routes(client: openai.OpenAI) -> None:
    for seed in (1, 2, 3):
        completion = client.completions.create(
            model=MODEL_NAME, prompt="?", max_tokens=10, temperature=1.0, seed=seed,
            extra_body={"guided_choice": ["north", "south"]},
        )
        assert completion.choices[0].text in ("north", "south")
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "code?"}], max_tokens=20, temperature=1.0,
            seed=seed, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"},
        )
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", chat.choices[0].message.content)
    guided = client.completions.create(
        model=MODEL_NAME, prompt="JSON:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"guided_json": SCHEMAS["one_of_tagged"], "guided_decoding_backend": "guidance"},
    )
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMAS["one_of_tagged"])
    grammar = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "yes?"}], max_tokens=8, temperature=0,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )
    assert grammar.choices[0].message.content in ("yes", "no")


def test_json_object_response_format(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "{}"}], max_tokens=64, temperature=0,
        response_format={"type": "json_object"},
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an unbounded language cut by max_tokens: still the start of an object
        assert response.usage.completion_tokens == 64
        assert choice.message.content.lstrip().startswith("{") and is_json_prefix(choice.message.content)


@pytest.mark.parametrize(("body", "param", "problem"), [
    ({"response_format": _response_format({"type": "object", "properties": {"a": {"type": "wat"}}})},
     "response_format.json_schema.schema", 'Unsupported type "wat"'),
    ({"response_format": _response_format({"type": "object", "if": {}, "then": {}})},
     "response_format.json_schema.schema", "'if' at #"),
    ({"response_format": _response_format({"$ref": "#/$defs/nowhere"})},
     "response_format.json_schema.schema", "nowhere"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "required"),
    ({"structured_outputs": {"grammar": 'root ::= "a" missing_rule'}}, "structured_outputs.grammar",
     "missing_rule"),
    ({"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "backend": "nope"}}, "structured_outputs.backend", "registered"),
    ({"structured_outputs": {"grammar": "root ::= bad", "backend": "guidance"}}, "structured_outputs.grammar",
     "llguidance"),
    # Bounded grammars: refused before any parser runs, naming the limit.
    ({"structured_outputs": {"json": _nested(400)}}, "structured_outputs.json",
     "nesting depth 400 exceeds structured_output.max_schema_depth = 64"),
    ({"response_format": _response_format(_nested(400))}, "response_format.json_schema.schema",
     "structured_output.max_schema_depth = 64"),
    ({"structured_outputs": {"regex": "a" * 140_000}}, "structured_outputs.regex",
     "size 140000 bytes exceeds structured_output.max_spec_bytes = 131072"),
    # vLLM's guided_* aliases: their errors name the alias the client sent.
    ({"guided_regex": "([a-z]"}, "guided_regex", "parenthesis"),
    ({"guided_json": _nested(400)}, "guided_json", "structured_output.max_schema_depth = 64"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice", "structured_outputs"),
    ({"guided_json": {}, "response_format": {"type": "json_object"}}, "guided_json", "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined with guided_regex"),
    ({"guided_decoding_backend": "guidance"}, "guided_decoding_backend", "needs a constraint"),
    ({"guided_regex": "a", "guided_decoding_backend": "nope"}, "guided_decoding_backend", "registered"),
])
def test_bad_specs_are_400s_naming_the_problem(server: ServerProcess, client: openai.OpenAI, body: dict,
                                                param: str, problem: str) -> None:
    for route, payload in (("completions", {"prompt": "x"}),
                           ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = httpx.post(f"{server.base_url}/v1/{route}", json={"model": MODEL_NAME, "max_tokens": 8,
                                                                    **payload, **body}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and problem in error["message"], error
    # The server keeps serving.
    ok = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_openai_client_raises_bad_request_for_a_bad_schema(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="minimum greater than maximum"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format=_response_format({"type": "integer", "minimum": 5, "maximum": 1}), stream=True,
        )
