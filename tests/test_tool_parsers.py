"""The tool_parser plugin kind: the built-in Hermes parser on exact inputs,
its conformance suite (and a broken parser, registered by a test plugin,
failing it with the rule named), and the JSON schema that forces
`required` / named calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from pagedllm.entrypoints.openai.forced_tool_calls import ForcedCallsReader, read_forced_calls
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.tool_calls import MAX_PARALLEL_TOOL_CALLS, plan_tool_calls
from pagedllm.plugins import PluginKind, get_plugin_manager, hookimpl
from pagedllm.plugins.hookspecs import RegisterFn
from pagedllm.testing import ConformanceError, load_suite, run_suite
from pagedllm.tool_parsers.base import ToolParser, ToolParserDelta, ToolRequest, ToolSpec
from pagedllm.tool_parsers.hermes import HermesToolParser, partial_tag_length, split_tool_calls

REQUEST = ToolRequest((ToolSpec("get_weather"), ToolSpec("add")))


def _whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    result = HermesToolParser(None).extract_tool_calls(text, REQUEST)
    return result.content, [(call.name, call.arguments) for call in result.tool_calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("just text", "just text", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', None, [("add", '{"a": 1}')]),
    # arguments written as JSON text are read as the object they spell
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", '{"a": 1}')]),
    # missing arguments: no arguments
    ('<tool_call>{"name": "add"}</tool_call>', None, [("add", "{}")]),
    # the newlines between blocks are not content; text around calls is, as written
    ('Sure: <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Zürich"}}</tool_call>\n', "Sure: ",
     [("add", "{}"), ("get_weather", '{"city": "Zürich"}')]),
    ('<tool_call>{"name": "add", "arguments": {}}</tool_call> then more', " then more", [("add", "{}")]),
    # not calls: bad JSON, a list, no name, an unknown tool, non-object arguments, unclosed
    ("<tool_call>{bad}</tool_call>", "<tool_call>{bad}</tool_call>", []),
    ("<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
     []),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ('x <tool_call>{"name": "add"', 'x <tool_call>{"name": "add"', []),
    # a hostile body: nesting past Python's recursion limit is content, not a crash
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "<tool_call>" + "[" * 100_000 + "</tool_call>", []),
])
def test_hermes_splits_calls_from_content(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    assert _whole(text) == (content, calls)


def test_hermes_accepts_any_name_when_the_request_lists_no_tools() -> None:
    content, calls = split_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', ToolRequest(), True)
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("rm", "{}")])


def test_partial_tag_length_is_the_longest_tag_prefix_at_the_end() -> None:
    assert [partial_tag_length(t) for t in ("abc", "a<", "a<tool_", "a<tool_call", "<tool_call>", "<x")] == [
        0, 1, 6, 10, 0, 0]


def test_hermes_streaming_holds_back_markup_and_releases_a_call_when_its_block_closes() -> None:
    parser = HermesToolParser(None)
    steps = ["Hi ", "<tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>", "\n", "bye"]
    released: list[ToolParserDelta | None] = []
    text = ""
    for delta in steps:
        released.append(parser.extract_tool_calls_streaming(text, text + delta, delta, REQUEST))
        text += delta
    released.append(parser.finish_streaming(text, REQUEST))
    contents = [None if r is None else r.content for r in released]
    assert contents == ["Hi ", None, None, None, None, None, "\nbye", None]
    call_step = released[4]
    assert call_step is not None
    assert [(p.index, p.name, p.arguments) for p in call_step.tool_calls] == [(0, "add", ""), (0, None, '{"a": 1}')]


def test_hermes_streaming_releases_an_unfinished_tag_at_the_end() -> None:
    parser = HermesToolParser(None)
    assert parser.extract_tool_calls_streaming("", "a <tool_c", "a <tool_c", REQUEST) == ToolParserDelta("a ")
    assert parser.finish_streaming("a <tool_c", REQUEST) == ToolParserDelta("<tool_c")


def test_conformance_suite_passes_for_hermes() -> None:
    assert [rule.name for rule in load_suite("tool_parser").rules] == [
        "builds", "examples-have-calls", "plain-text-is-content", "stream-matches-whole", "no-markup-leak"]
    run_suite("tool_parser", "hermes")


class LeakyParser(HermesToolParser):
    """Streams text the moment it arrives: markup reaches the client."""

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: ToolRequest
    ) -> ToolParserDelta | None:
        return ToolParserDelta(delta_text) if delta_text else None

    def finish_streaming(self, current_text: str, request: ToolRequest) -> ToolParserDelta | None:
        return None


class NoExamplesParser(ToolParser):
    def extract_tool_calls(self, model_output: str, request: ToolRequest) -> Any:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     request: ToolRequest) -> ToolParserDelta | None:
        raise NotImplementedError


class BrokenToolParsersPlugin:
    @hookimpl
    def register_tool_parsers(self, register: RegisterFn) -> None:
        register("leaky", LeakyParser)
        register("no_examples", NoExamplesParser)


@pytest.fixture
def broken_parsers() -> Iterator[None]:
    manager = get_plugin_manager()
    name = manager.register(BrokenToolParsersPlugin(), name="broken-tool-parsers")
    try:
        yield
    finally:
        manager.unregister(name=name)


def test_broken_parsers_fail_the_suite_naming_the_rule(broken_parsers: None) -> None:
    manager = get_plugin_manager()
    assert {"hermes", "leaky", "no_examples"} <= set(manager.tool_parsers.names())
    assert manager.registry(PluginKind.TOOL_PARSER).get("leaky").source == "broken-tool-parsers"
    with pytest.raises(ConformanceError) as caught:
        run_suite("tool_parser", "leaky")
    assert caught.value.rule == "stream-matches-whole" and "<tool_call>" in str(caught.value)
    with pytest.raises(ConformanceError) as caught:
        run_suite("tool_parser", "no_examples")
    assert caught.value.rule == "builds" and "conformance_examples" in str(caught.value)


def _plan(**fields: Any) -> Any:
    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "now"}},
    ]
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                    **fields})
    return plan_tool_calls(request, None)


def test_required_schema_accepts_exactly_calls_of_the_offered_tools() -> None:
    forced = _plan(tool_choice="required").structured_outputs()
    schema = forced.json
    good = [{"name": "add", "parameters": {"a": 1}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "add", "parameters": {}}], [{"name": "sub", "parameters": {"a": 1}}],
                [{"name": "now", "parameters": {}, "extra": 1}], [{"name": "now", "parameters": {}}] * 17):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["maxItems"] == MAX_PARALLEL_TOOL_CALLS
    single = _plan(tool_choice="required", parallel_tool_calls=False).structured_outputs().json
    assert (single["minItems"], single["maxItems"]) == (1, 1)
    assert read_forced_calls(json.dumps(good)) == [("add", '{"a": 1}'), ("now", "{}")]


@pytest.mark.parametrize(("text", "calls"), [
    ('[{"name": "add", "parameters": {"a": 1}}]', [("add", '{"a": 1}')]),
    # whitespace the grammar allows: kept inside the arguments, dropped around them
    ('[ {\n "name" : "add" ,\n "parameters" :  {\n  "a" : [1, {"b": "}]\\""}]\n }  } ,'
     '{"name":"now","parameters":{}}\n]',
     [("add", '{\n  "a" : [1, {"b": "}]\\""}]\n }'), ("now", "{}")]),
    # a name with escapes; scalar parameters (a schema without "type": "object")
    ('[{"name": "a\\"b", "parameters": 5 }, {"name": "s", "parameters": "x,}"}]', [('a"b', "5"), ("s", '"x,}"')]),
    # cut by max_tokens: the calls started so far, the last one unfinished
    ('[{"name": "add", "parameters": {"a": ', [("add", '{"a": ')]),
    ('[{"name": "ad', []),
    ("", []),
])
def test_forced_calls_read_whole_and_streamed_alike(text: str, calls: list[tuple[str, str]]) -> None:
    assert read_forced_calls(text) == calls
    for size in (1, 2, 5):
        reader = ForcedCallsReader()
        streamed: dict[int, list[str]] = {}
        for start in range(0, len(text), size):
            reader.feed(text[start:start + size])
            for index, name, arguments in reader.take_pieces():
                if name is not None:
                    assert index == len(streamed) and arguments == ""
                    streamed[index] = [name, ""]
                streamed[index][1] += arguments or ""
        assert [tuple(call) for call in streamed.values()] == calls


def test_named_schema_is_the_functions_parameters() -> None:
    assert _plan(tool_choice={"type": "function", "function": {"name": "add"}}).structured_outputs().json == {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _plan(tool_choice={"type": "function", "function": {"name": "now"}}).structured_outputs().json == {
        "type": "object", "properties": {}}
    assert _plan(tool_choice="none").structured_outputs() is None
