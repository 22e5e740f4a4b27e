"""Reasoning end to end, on the test plugin's scripted model (the tiny
models never write <think>): the model writes
`<think>Let me think.</think>hello`, and prefers `{"answer":42}` wherever
`hello` or `<think>` is not allowed.

- through the `openai` client against a real `pagedllm serve
  --reasoning-parser think`: `reasoning_content` split from `content`,
  streamed and not, the streamed pieces adding up to the whole;
- with structured output the grammar applies only after `</think>`: the
  reasoning is free text, the content parses against the schema (the model
  wanted `hello`); without a parser the grammar applies from the first token;
- with n-gram drafting, drafts that cross `</think>` are constrained from
  the end tag on: greedy output equals the output without drafts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers.scripted_model import build_scripted_model, chain_script, scripted_tokenizer
from helpers.server import ServerProcess, free_port, start_server

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.llm import LLM

MODEL_NAME = "scripted-reasoner"
TAGS = ["<think>", "</think>"]
REASONING = "Let me think."
SCRIPTED_ANSWER = "hello"
JSON_ANSWER = '{"answer":42}'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scripted")
    tokenizer = scripted_tokenizer(root / "tokenizer", TAGS)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    reasoning, answer, json_answer = encode(f"<think>{REASONING}</think>"), encode(SCRIPTED_ANSWER), encode(JSON_ANSWER)
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    # </think> -> hello, or the JSON where hello is masked; any other token -> <think>, or the JSON.
    script = chain_script(reasoning, [answer[0], json_answer[0]])
    script.update(chain_script(json_answer, stop))
    script[answer[0]] = stop
    return build_scripted_model(root / "model", TAGS, script, default=[reasoning[0], json_answer[0]])


def _json_params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=json.dumps(SCHEMA)), **kwargs)


def _text(llm: LLM, prompt: str, params: SamplingParams) -> str:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


# ------------------------------------------------------------ in process


def test_the_grammar_applies_only_after_the_reasoning_section(model_dir: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    with_parser = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, reasoning_parser="think")
    # The script unconstrained, then under the schema: reasoning free, the answer JSON.
    assert _text(with_parser, "Question?\n", greedy) == f"<think>{REASONING}</think>{SCRIPTED_ANSWER}"
    assert _text(with_parser, "Question?\n", _json_params()) == f"<think>{REASONING}</think>{JSON_ANSWER}"
    # A prompt that opened the section (the template's <think>): the same, without the start tag.
    assert _text(with_parser, "Question?\n<think>", _json_params()) == f"{REASONING}</think>{JSON_ANSWER}"
    del with_parser
    # No reasoning parser: the grammar holds from the first token, so no <think> at all.
    without = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256)
    assert _text(without, "Question?\n", _json_params()) == JSON_ANSWER


def test_async_scheduling_waits_for_the_end_of_reasoning_too(model_dir: Path) -> None:
    # A step of a request still reasoning is sync_required: the next step's
    # bitmask depends on whether that step wrote </think>.
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, reasoning_parser="think", async_scheduling=True)
    assert llm.engine_core.engine_core.scheduler.async_scheduling
    outputs = llm.generate(["Question?\n", "Other question?\n"], [_json_params(), SamplingParams(
        temperature=0.0, max_tokens=40)], use_tqdm=False)
    assert [output.outputs[0].text for output in outputs] == [
        f"<think>{REASONING}</think>{JSON_ANSWER}", f"<think>{REASONING}</think>{SCRIPTED_ANSWER}"
    ]


def test_drafts_that_cross_the_end_tag_are_constrained_after_it(model_dir: Path) -> None:
    # The prompt holds the whole scripted reply, so n-gram drafts propose
    # "</think>hello" from it; the schema must reject "hello" after "</think>".
    prompt = f"<think>{REASONING}</think>{SCRIPTED_ANSWER}\n<think>"
    expected = f"{REASONING}</think>{JSON_ANSWER}"
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256, reasoning_parser="think",
              speculative_config=speculative)
    gate = llm.engine_core.engine_core.structured_output_manager.reasoning
    free_rows = gate.num_free_rows
    crossings: list[tuple[int, int]] = []

    def recording(output_token_ids: Any, draft_token_ids: Any) -> int:
        num_free = free_rows(output_token_ids, draft_token_ids)
        if num_free <= len(draft_token_ids):
            crossings.append((num_free, len(draft_token_ids)))
        return num_free

    gate.num_free_rows = recording  # type: ignore[method-assign]
    assert _text(llm, prompt, _json_params()) == expected
    assert crossings, "no draft crossed </think>: the test did not exercise the crossing"
    assert any(0 < num_free <= num_drafts for num_free, num_drafts in crossings)
    assert llm.engine_core.engine_core.scheduler.total_spec_decoding_stats.num_draft_tokens > 0


# ------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    args = ("--reasoning-parser", "think", "--num-kv-blocks", "64", "--served-model-name", MODEL_NAME)
    with start_server(model_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _response_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str, str | None, list[dict[str, Any]]]:
    reasoning, content, finish_reason, deltas = "", "", None, []
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=40,
                                            stream=True, **kwargs)
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        deltas.append(delta)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "") or ""
        finish_reason = choice.finish_reason or finish_reason
    return reasoning, content, finish_reason, deltas


def test_chat_reply_carries_reasoning_content(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=40)
    message = response.choices[0].message
    assert message.content == SCRIPTED_ANSWER
    assert message.model_extra["reasoning_content"] == REASONING
    assert response.choices[0].finish_reason == "stop"


def test_streamed_deltas_split_reasoning_from_content_like_the_whole_reply(client: openai.OpenAI) -> None:
    reasoning, content, finish_reason, deltas = _streamed(client)
    assert (reasoning, content, finish_reason) == (REASONING, SCRIPTED_ANSWER, "stop")
    # Reasoning deltas first, then content deltas; no tag in any of them.
    kinds = [key for delta in deltas for key in ("reasoning_content", "content") if delta.get(key)]
    assert kinds == sorted(kinds, key=lambda key: key == "content") and "reasoning_content" in kinds
    assert not any("think>" in str(delta) for delta in deltas)


def test_structured_output_parses_after_the_reasoning_streamed_and_not(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=40,
                                              response_format=_response_format())
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING  # not JSON: the grammar waited
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert json.loads(message.content) == {"answer": 42}
    reasoning, content, finish_reason, _ = _streamed(client, response_format=_response_format())
    assert (reasoning, json.loads(content), finish_reason) == (REASONING, {"answer": 42}, "stop")
    # vLLM's structured_outputs body field, and json_object (what vLLM users send for "any JSON").
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=40,
                                              extra_body={"structured_outputs": {"json": SCHEMA}})
    assert response.choices[0].message.model_extra["reasoning_content"] == REASONING
    assert json.loads(response.choices[0].message.content) == {"answer": 42}
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0.0, max_tokens=40,
                                              response_format={"type": "json_object"})
    assert response.choices[0].message.model_extra["reasoning_content"] == REASONING
    assert json.loads(response.choices[0].message.content) == {"answer": 42}


def test_serve_with_an_unknown_parser_fails_at_start_naming_the_key(model_dir: Path) -> None:
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model_dir), "--reasoning-parser",
               "deepseek", "--host", "127.0.0.1", "--port", str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    message = "structured_output.reasoning_parser='deepseek' is invalid; allowed: a registered reasoning parser: "
    assert message in result.stderr
    assert "think" in result.stderr.split(message, 1)[1].splitlines()[0]
