"""Bounded JSON whitespace: with max_whitespace = k a JSON grammar accepts a
run of k whitespace characters between two tokens and refuses k + 1; 0 is
disable_any_whitespace; and on a random-weight model, a constrained request
ends with valid JSON (finish_reason "stop") where unbounded whitespace runs
out of max_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import StructuredOutputConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.llm import LLM
from pagedllm.entrypoints.openai.protocol import StructuredOutputsRequest
from pagedllm.model_registry.tokenizer import load_tokenizer
from pagedllm.structured_output.interface import StructuredOutputKind
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.whitespace import WhitespaceOptions, backend_kwargs, resolve_whitespace
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

# Every place JSON allows whitespace, marked "~" (object, array, both separators).
TEMPLATE = '{~"a"~:~[~1~,~2~]~,~"b"~:~true~}'
TEMPLATE_SCHEMA = {
    "type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}, "b": {"type": "boolean"}},
    "required": ["a", "b"], "additionalProperties": False,
}
NUM_SLOTS = TEMPLATE.count("~")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=5)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> XgrammarBackend:
    tokenizer = load_tokenizer(str(model_dir))
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id, StructuredOutputConfig())


def _with_run(slot: int, run: str) -> str:
    """TEMPLATE with `run` at whitespace slot `slot` and nothing at the others."""
    parts = TEMPLATE.split("~")
    return "".join(part + (run if index == slot else "") for index, part in enumerate(parts[:-1])) + parts[-1]


def _accepts(grammar: Any, text: str) -> bool:
    matcher = grammar.fork().matcher
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


@pytest.mark.parametrize("max_whitespace", [1, 3])
def test_a_run_of_k_is_accepted_and_k_plus_one_refused_at_every_slot(
    backend: XgrammarBackend, max_whitespace: int
) -> None:
    grammar = backend.compile(StructuredOutputKind.JSON, json.dumps(TEMPLATE_SCHEMA), max_whitespace=max_whitespace)
    for slot in range(NUM_SLOTS):
        for char in (" ", "\n", "\r"):
            assert _accepts(grammar, _with_run(slot, char * max_whitespace)), (slot, char)
            assert not _accepts(grammar, _with_run(slot, char * (max_whitespace + 1))), (slot, char)
        mixed = (" \n" * max_whitespace)[:max_whitespace]
        assert _accepts(grammar, _with_run(slot, mixed)) and not _accepts(grammar, _with_run(slot, mixed + " "))
    # Unbounded (None) takes any run; json_object is bounded like a schema.
    unbounded = backend.compile(StructuredOutputKind.JSON, json.dumps(TEMPLATE_SCHEMA), max_whitespace=None)
    assert _accepts(unbounded, _with_run(0, " " * 50))
    any_object = backend.compile(StructuredOutputKind.JSON_OBJECT, "", max_whitespace=max_whitespace)
    assert _accepts(any_object, _with_run(5, " " * max_whitespace))
    assert not _accepts(any_object, _with_run(5, " " * (max_whitespace + 1)))


def test_token_sequences_are_bounded_the_same_way(backend: XgrammarBackend) -> None:
    tokenizer = backend.tokenizer
    grammar = backend.compile(StructuredOutputKind.JSON, json.dumps(TEMPLATE_SCHEMA), max_whitespace=2)
    for run, accepted in (("  ", True), ("\n\n", True), ("   ", False), ("\n\n\n", False)):
        token_ids = tokenizer.encode(_with_run(3, run), add_special_tokens=False)
        assert grammar.fork().accept_tokens("r", token_ids) is accepted, repr(run)


def test_zero_is_disable_any_whitespace_and_shares_its_grammar(model_dir: Path) -> None:
    config = StructuredOutputConfig()
    none = WhitespaceOptions(any_whitespace=False, max_whitespace=None)
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA, max_whitespace=0), config) == none
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA, disable_any_whitespace=True), config) == none
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA), StructuredOutputConfig(max_whitespace=0)) == none
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA, max_whitespace=9), StructuredOutputConfig(
        disable_any_whitespace=True)) == none
    # The request's value wins over the engine's; the engine's default is 4.
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA), config) == (True, 4)
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA, max_whitespace=7), config) == (True, 7)
    assert resolve_whitespace(SO(json=TEMPLATE_SCHEMA), StructuredOutputConfig(max_whitespace=None)) == (True, None)
    manager = StructuredOutputManager(config, vocab_size=8192, tokenizer=str(model_dir), eos_token_id=2,
                                      max_num_rows=2)
    requests = [Request(str(index), [1], SamplingParams(structured_outputs=so), eos_token_id=2)
                for index, so in enumerate([SO(json=TEMPLATE_SCHEMA, max_whitespace=0),
                                            SO(json=TEMPLATE_SCHEMA, disable_any_whitespace=True),
                                            SO(json=TEMPLATE_SCHEMA, max_whitespace=3)])]
    for request in requests:
        manager.grammar_init(request)
    keys = [request.structured_output_request.key for request in requests]
    assert keys[0] == keys[1] and keys[2].max_whitespace == 3
    assert (manager.stats.hits, manager.stats.misses) == (1, 2)
    manager.close()


@pytest.mark.parametrize("value", [-1, 65, 2**70, True, "2", 1.5])
def test_max_whitespace_must_be_a_small_integer(value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SO(json=TEMPLATE_SCHEMA, max_whitespace=value)
    assert info.value.field == "structured_outputs.max_whitespace"
    assert info.value.limit == "must be an integer in [0, 64]"
    if not isinstance(value, (bool, str, float)):
        with pytest.raises(pydantic.ValidationError, match="max_whitespace"):
            StructuredOutputsRequest(json=TEMPLATE_SCHEMA, max_whitespace=value)
    assert SO(json=TEMPLATE_SCHEMA, max_whitespace=64).max_whitespace == 64


def test_the_keyword_reaches_only_methods_that_name_it() -> None:
    def compile_1_0(kind: Any, spec: str, *, any_whitespace: bool = True) -> None: ...

    def compile_1_1(kind: Any, spec: str, *, any_whitespace: bool = True, max_whitespace: int | None = None) -> None:
        ...

    bounded = WhitespaceOptions(True, 3)
    assert backend_kwargs(compile_1_0, bounded) == {"any_whitespace": True}
    assert backend_kwargs(compile_1_1, bounded) == {"any_whitespace": True, "max_whitespace": 3}
    assert backend_kwargs(XgrammarBackend.validate, bounded) == {"any_whitespace": True, "max_whitespace": 3}


# ------------------------------------------------- on a random-weight model

# JSON of bounded length: booleans, enums, integer ranges, short strings,
# short arrays, closed objects with required fields.
BOUNDED_SCHEMAS: dict[str, dict[str, Any]] = {
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
              "required": ["ok", "level"], "additionalProperties": False},
    "ranged": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                "code": {"type": "string", "maxLength": 6}},
               "required": ["age", "code"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                       "maxItems": 3}},
             "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"enum": ["a", "b", None]}}, "required": ["point", "label"], "additionalProperties": False},
    "booleans": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
}
# Far above the longest text those schemas allow with runs of 4 (~130
# characters, each token at least one); measured outputs take 5-49 tokens.
MAX_TOKENS = 256
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def test_bounded_whitespace_json_from_a_random_weight_model_is_valid(model_dir: Path) -> None:
    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=512, max_num_seqs=32)
    cases = [(name, seed) for name in BOUNDED_SCHEMAS for seed in (None, 1, 2)]
    params = [
        SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=MAX_TOKENS,
                       structured_outputs=SO(json=BOUNDED_SCHEMAS[name]))
        for name, seed in cases
    ]
    outputs = llm.generate(["Give me JSON:"] * len(params), params, use_tqdm=False)
    for (name, seed), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, seed, completion.text)
        jsonschema.validate(json.loads(completion.text), BOUNDED_SCHEMAS[name])
        runs = re.findall(r"[ \n\r\t]+", _JSON_STRING.sub('""', completion.text))
        assert max(map(len, runs), default=0) <= 4, (name, seed, completion.text)


def test_unbounded_whitespace_runs_out_of_tokens_on_the_same_model(model_dir: Path) -> None:
    # What the bound prevents: greedy on this model pads with whitespace forever.
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=512, structured_outputs_config={"max_whitespace": None})
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=SO(json=BOUNDED_SCHEMAS["flags"]))
    completion = llm.generate(["Give me JSON:"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 64
    assert not completion.text.strip(" \n").endswith("}")
