"""Structured output end to end with LLM on a random-weight model: every
output parses and validates (jsonschema), regexes fully match, choices are
options, EBNF sentences belong to their language, and constraints never leak
into unconstrained requests of the same batch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers.json_prefix import is_json_prefix
from helpers.json_schemas import MAX_TOKENS, SCHEMAS
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.llm import LLM

PROMPTS = ["Give me JSON:", "hello", "The answer is", "x y z"]
SQL_GRAMMAR = r"""
root ::= select ";"
select ::= "SELECT " columns " FROM " table where?
columns ::= "*" | column (", " column){0,2}
column ::= "id" | "name" | "age"
table ::= "users" | "orders"
where ::= " WHERE " column " " op " " number
op ::= "=" | "<" | ">"
number ::= [1-9] [0-9]{0,2}
"""
# A parser of SQL_GRAMMAR's language, written independently of the grammar text.
SQL_SENTENCE = re.compile(
    r"SELECT (\*|(id|name|age)(, (id|name|age)){0,2}) FROM (users|orders)"
    r"( WHERE (id|name|age) [=<>] [1-9][0-9]{0,2})?;"
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=5)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=512, max_model_len=512, max_num_seqs=128)


def _params(structured: SO | None, *, seed: int | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured)


def test_json_schemas_always_validate_greedy_and_seeded(llm: LLM) -> None:
    assert len(SCHEMAS) >= 25
    names, prompts, params = [], [], []
    for index, (name, schema) in enumerate(SCHEMAS.items()):
        for seed in (None, 1000 + index):
            names.append((name, seed))
            prompts.append(PROMPTS[index % len(PROMPTS)])
            params.append(_params(SO(json=schema, disable_any_whitespace=True), seed=seed))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for (name, seed), output in zip(names, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, seed, completion.text)
        value = json.loads(completion.text)
        jsonschema.validate(value, SCHEMAS[name])


def test_any_whitespace_json_is_valid(llm: LLM) -> None:
    schema = SCHEMAS["flat_object"]
    # Free whitespace makes the language infinite: give it a closer look but a budget.
    outputs = llm.generate(PROMPTS[:2], [_params(SO(json=json.dumps(schema)))] * 2, use_tqdm=False)
    for output in outputs:
        _assert_object_or_cut_object_prefix(output.outputs[0], schema)


def test_regex_outputs_fully_match(llm: LLM) -> None:
    patterns = [r"[A-Z]{2}-[0-9]{3}", r"(yes|no), because [a-z]{1,8}\.", r"\d{1,3}(\.\d{1,3}){3}", r"[a-f0-9]{8}"]
    params = [_params(SO(regex=p), seed=seed) for p in patterns for seed in (None, 7)]
    outputs = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    for param, output in zip(params, outputs, strict=True):
        pattern = param.structured_outputs.regex
        assert re.fullmatch(pattern, output.outputs[0].text), (pattern, output.outputs[0].text)
        assert output.outputs[0].finish_reason == "stop"


def test_choice_outputs_are_options(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral", "it's \"complicated\""]
    params = [_params(SO(choice=choices), seed=seed) for seed in (None, 1, 2, 3, 4, 5)]
    outputs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].text in choices


def test_sql_like_ebnf_yields_a_sentence_of_its_language(llm: LLM) -> None:
    params = [_params(SO(grammar=SQL_GRAMMAR), seed=seed) for seed in (None, 11, 12, 13, 14, 15)]
    outputs = llm.generate(PROMPTS[1:2] * len(params), params, use_tqdm=False)
    for output in outputs:
        assert SQL_SENTENCE.fullmatch(output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"


def test_json_object_is_a_json_object(llm: LLM) -> None:
    # Any object is an unbounded language; the random model must only emit a
    # prefix of one, and when it stops, a whole object.
    outputs = llm.generate(PROMPTS[:2], [_params(SO(json_object=True, disable_any_whitespace=True), seed=3)] * 2,
                           use_tqdm=False)
    for output in outputs:
        _assert_object_or_cut_object_prefix(output.outputs[0], None)


def _assert_object_or_cut_object_prefix(completion: Any, schema: dict[str, Any] | None) -> None:
    """An unbounded language may run out of tokens: then the text is still the
    start of a JSON object and used the whole budget; otherwise it is a whole one."""
    text = completion.text
    assert completion.finish_reason in ("stop", "length"), completion.finish_reason
    if completion.finish_reason == "length":
        assert len(completion.token_ids) == MAX_TOKENS
        assert text.lstrip().startswith("{") and is_json_prefix(text), text
        return
    value = json.loads(text)
    assert isinstance(value, dict), text
    if schema is not None:
        jsonschema.validate(value, schema)


def test_json_prefix_checker_accepts_prefixes_and_rejects_the_rest() -> None:
    # The check above must be able to fail.
    for prefix in ('{"a": [1, tr', '{"a": "x\\u00', ' {"a": -1.5e', '{"a": {}, "b"'):
        assert is_json_prefix(prefix), prefix
    for not_prefix in ('{"a"}', '{"a": 01', '[1,]', '{"a": 1}}', '{"a": "\\x'):
        assert not is_json_prefix(not_prefix), not_prefix


def test_unconstrained_requests_are_token_identical_in_a_mixed_batch(llm: LLM) -> None:
    plain = [_params(None, max_tokens=24), _params(None, seed=42, max_tokens=24),
             _params(None, max_tokens=24), _params(None, seed=43, max_tokens=24)]
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = [_params(SO(json=SCHEMAS["nested_object"], disable_any_whitespace=True)),
                   _params(SO(regex=r"[a-z]{3,9}"), seed=9), _params(SO(choice=["a", "b"]))]
    mixed_prompts = [PROMPTS[0], "c1", PROMPTS[1], "c2", PROMPTS[2], "c3", PROMPTS[3]]
    mixed_params = [plain[0], constrained[0], plain[1], constrained[1], plain[2], constrained[2], plain[3]]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["nested_object"])


def test_invalid_schema_is_refused_before_scheduling(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"structured_outputs.json.*Unsupported type \"frobnicate\""):
        llm.generate("x", _params(SO(json={"type": "frobnicate"})), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="'not' at #/properties/a"):
        llm.generate("x", _params(SO(json={"type": "object", "properties": {"a": {"not": {}}}})), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.grammar.*undefined_rule"):
        llm.generate("x", _params(SO(grammar="root ::= undefined_rule")), use_tqdm=False)
    assert llm.generate("x", _params(SO(choice=["ok"])), use_tqdm=False)[0].outputs[0].text == "ok"


def test_compile_failure_in_the_core_ends_only_that_request(llm: LLM) -> None:
    # Bypasses the API-side validation, as a request that slipped past it.
    core = llm.engine_core.engine_core
    eos = llm.eos_token_id
    core.add_request(Request("plain", [5, 6, 7], _params(None, max_tokens=6), eos_token_id=eos))
    core.add_request(Request("bad", [5, 6, 7], _params(SO(regex="(unclosed")), eos_token_id=eos))
    core.add_request(Request("good", [5, 6, 7], _params(SO(regex="[0-9]{4}")), eos_token_id=eos))
    finished = {}
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finished[output.request_id] = output
    assert finished["bad"].finish_reason == "abort"
    assert "failed to compile" in finished["bad"].stop_reason and "parenthesis" in finished["bad"].stop_reason
    assert tokens.get("bad", []) == []
    assert finished["plain"].finish_reason == "length" and len(tokens["plain"]) == 6
    good_text = llm.tokenizer.decode(tokens["good"][:-1])
    assert finished["good"].finish_reason == "stop" and re.fullmatch("[0-9]{4}", good_text)


def test_grammar_termination_stops_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured_outputs=SO(choice=["done"]))
    completion = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == llm.eos_token_id and len(completion.token_ids) <= 5


def test_logprobs_stay_raw_under_a_grammar(llm: LLM) -> None:
    constrained = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, structured_outputs=SO(choice=["7"]))
    plain = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    masked, raw = llm.generate(["same prompt", "same prompt"], [constrained, plain], use_tqdm=False)
    chosen = masked.outputs[0].token_ids[0]
    assert llm.tokenizer.decode([chosen]) == "7"
    # The top-3 are the unconstrained model's, not the grammar's single token.
    top_masked = {t: lp.logprob for t, lp in masked.outputs[0].logprobs[0].items() if t != chosen}
    top_raw = {t: lp.logprob for t, lp in raw.outputs[0].logprobs[0].items()}
    assert set(top_masked) <= set(top_raw)
    assert all(abs(top_masked[t] - top_raw[t]) < 1e-5 for t in top_masked)
