"""Conformance suite of the ``tool_parser`` kind.

A parser is run on scripted model outputs: its own ``conformance_examples``
(which must hold calls of :data:`SUITE_TOOLS`), plain prose, and Hermes-style
markup, whole and malformed. Each text is streamed through a fresh parser
cut into deltas every way the suite tries (one character at a time, whole,
and seeded random cuts), and must give what ``extract_tool_calls`` gives.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass
from typing import Any

from pagedllm.testing.suite import ConformanceError, Suite
from pagedllm.tool_parsers.base import ExtractedToolCalls, ToolParser, ToolRequest, ToolSpec

SUITE = Suite("tool_parser")

# The tools every scripted output may call.
SUITE_TOOLS = ToolRequest((
    ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    ToolSpec("search", {"type": "object", "properties": {"query": {"type": "string"}}}),
    ToolSpec("now", {"type": "object", "properties": {}}),
))
# Text no parser may read a call in: it comes back as content, unchanged.
PLAIN_OUTPUTS = (
    "The weather in Paris is mild.",
    "  leading and trailing spaces  \n",
    "def f(x):\n    return {'name': x} < 3\n",
    "a < b and c > d; <b>bold</b> <tool",
    "héllo wörld ✓ 日本語",
    "",
)
# Hermes-style markup, complete and broken: whatever a parser makes of it,
# streaming must agree with the whole text.
MARKUP_OUTPUTS = (
    'Hi<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n\n'
    '<tool_call>{"name": "search", "arguments": {"query": "a</b>"}}</tool_call>\ndone',
    '<tool_call>{"name": "get_weather", "arguments": {city}}</tool_call> after a broken call',
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    'text then an unclosed <tool_call>{"name": "now", "arguments": {}',
    "a partial tag at the end <tool_ca",
    "a stray </tool_call> closing tag",
    '<tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call></tool_call>',
)
NUM_RANDOM_CUTS = 12
SEED = 1234


@dataclass
class Streamed:
    content: str
    calls: list[tuple[str, str]]  # (name, arguments) by index
    content_so_far: list[str]  # the content sent after each step


def _parser_cls(name: str) -> type[ToolParser]:
    from pagedllm.plugins import get_plugin_manager

    parser_cls: type[ToolParser] = get_plugin_manager().tool_parsers.load(name)
    return parser_cls


@functools.cache
def _tokenizer() -> Any:
    """The shipped model's tokenizer: what a parser is built with here."""
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))


def _whole(parser_cls: type[ToolParser], text: str) -> ExtractedToolCalls:
    return parser_cls(_tokenizer()).extract_tool_calls(text, SUITE_TOOLS)


def stream(parser_cls: type[ToolParser], text: str, cuts: list[int], rule: str) -> Streamed:
    """`text` cut at `cuts` through a fresh parser; call pieces checked as they come."""
    parser = parser_cls(_tokenizer())
    content = ""
    calls: list[tuple[str, str]] = []
    content_so_far: list[str] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    previous = ""
    for step, (start, end) in enumerate(itertools.pairwise(bounds)):
        current = text[:end]
        released = [parser.extract_tool_calls_streaming(previous, current, text[start:end], SUITE_TOOLS)]
        if step == len(bounds) - 2:
            released.append(parser.finish_streaming(current, SUITE_TOOLS))
        previous = current
        for delta in released:
            if delta is None:
                continue
            content += delta.content or ""
            for piece in delta.tool_calls:
                if piece.index == len(calls):
                    if not piece.name:
                        raise ConformanceError(rule, f"call {piece.index} started without its name ({text!r})")
                    calls.append((piece.name, ""))
                elif piece.index != len(calls) - 1 or piece.name is not None:
                    raise ConformanceError(
                        rule, f"piece {piece} out of order after {len(calls)} calls started ({text!r})"
                    )
                name, arguments = calls[piece.index]
                calls[piece.index] = (name, arguments + (piece.arguments or ""))
        content_so_far.append(content)
    return Streamed(content, calls, content_so_far)


def _cuts(text: str) -> list[list[int]]:
    rng = random.Random(f"{SEED}:{text}")
    every_char = list(range(1, len(text)))
    ways = [[], every_char]
    for _ in range(NUM_RANDOM_CUTS):
        ways.append(sorted(rng.sample(every_char, rng.randint(0, len(every_char))) if every_char else []))
    return ways


def _corpus(parser_cls: type[ToolParser]) -> tuple[str, ...]:
    return (*parser_cls.conformance_examples, *PLAIN_OUTPUTS, *MARKUP_OUTPUTS)


@SUITE.rule("builds")
def check_builds(name: str) -> None:
    """Registered as a ToolParser subclass, built from a tokenizer, with examples."""
    parser_cls = _parser_cls(name)
    if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolParser)):
        raise ConformanceError("builds", f"{parser_cls!r} is not a ToolParser subclass")
    parser_cls(_tokenizer())
    if not parser_cls.conformance_examples:
        raise ConformanceError("builds", "declares no conformance_examples (outputs with calls, in its format)")


@SUITE.rule("examples-have-calls")
def check_examples(name: str) -> None:
    """Each example yields calls of the suite's tools, arguments a JSON object."""
    parser_cls = _parser_cls(name)
    for text in parser_cls.conformance_examples:
        result = _whole(parser_cls, text)
        if not result.tool_calls:
            raise ConformanceError("examples-have-calls", f"no call read from its example {text!r}")
        for call in result.tool_calls:
            if call.name not in SUITE_TOOLS.names():
                raise ConformanceError("examples-have-calls", f"call of unknown tool {call.name!r} in {text!r}")
            try:
                arguments = json.loads(call.arguments)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ConformanceError(
                    "examples-have-calls", f"arguments {call.arguments!r} are not a JSON object ({text!r})"
                )


@SUITE.rule("plain-text-is-content")
def check_plain_text(name: str) -> None:
    """Text without calls comes back as content, unchanged, whole and streamed."""
    parser_cls = _parser_cls(name)
    for text in PLAIN_OUTPUTS:
        result = _whole(parser_cls, text)
        if result.tool_calls or (result.content or "") != text:
            raise ConformanceError("plain-text-is-content", f"{text!r} became {result}")
        streamed = stream(parser_cls, text, list(range(1, len(text))), "plain-text-is-content")
        if streamed.calls or streamed.content != text:
            raise ConformanceError("plain-text-is-content", f"{text!r} streamed as {streamed.content!r}")


@SUITE.rule("stream-matches-whole")
def check_stream_matches_whole(name: str) -> None:
    """Any cut into deltas streams the same content and calls as the whole text."""
    parser_cls = _parser_cls(name)
    for text in _corpus(parser_cls):
        whole = _whole(parser_cls, text)
        expected_calls = [(call.name, call.arguments) for call in whole.tool_calls]
        for cuts in _cuts(text):
            streamed = stream(parser_cls, text, cuts, "stream-matches-whole")
            if streamed.content != (whole.content or "") or streamed.calls != expected_calls:
                raise ConformanceError(
                    "stream-matches-whole",
                    f"{text!r} cut at {cuts}: streamed content {streamed.content!r} and calls {streamed.calls}, "
                    f"whole content {whole.content!r} and calls {expected_calls}",
                )


@SUITE.rule("no-markup-leak")
def check_no_markup_leak(name: str) -> None:
    """Content sent at every step is a prefix of the final content: nothing
    sent is ever taken back, so a call's markup never reaches the client."""
    parser_cls = _parser_cls(name)
    for text in _corpus(parser_cls):
        final = _whole(parser_cls, text).content or ""
        for cuts in _cuts(text):
            for sent in stream(parser_cls, text, cuts, "no-markup-leak").content_so_far:
                if not final.startswith(sent):
                    raise ConformanceError(
                        "no-markup-leak", f"{text!r} cut at {cuts}: sent {sent!r}, not a prefix of {final!r}"
                    )
