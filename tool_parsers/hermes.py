"""Hermes-style tool calls (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3):

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Every ``<tool_call>...</tool_call>`` block whose body is a JSON object with a
``name`` among the request's tools and an object ``arguments`` is a call;
any other block (bad JSON, unknown name) stays in the content as written.
Content is all the text outside the calls, as written, less the runs of
whitespace alone between calls (the newlines a model puts between blocks).

Streaming holds back what might still be markup: an unclosed block, a
partial ``<tool_c`` at the end, and a run of whitespace alone (dropped if a
call follows it). A call is released once its block closes: one piece with its
name, then one with its arguments. So no markup ever leaks into content, and
a malformed block falls back to content exactly as without streaming.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.tool_parsers.base import (
    DeltaFunctionCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolParser,
    ToolParserDelta,
    ToolRequest,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def parse_call_body(body: str, request: ToolRequest) -> FunctionCall | None:
    """The call a block's body stands for, or None when it is not one."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name or (request.tools and name not in request.names()):
        return None
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(name, json.dumps(arguments, ensure_ascii=False))


def partial_tag_length(text: str, tag: str = TOOL_CALL_START) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def split_tool_calls(
    text: str, request: ToolRequest, final: bool, parsed: dict[str, FunctionCall | None] | None = None
) -> tuple[str, list[FunctionCall]]:
    """(content, calls) of ``text``. With ``final`` False the text may go on:
    only what no continuation can change is returned, so the result for a
    prefix is always a prefix of the result for the whole text. ``parsed``
    caches block bodies already read (a stream re-reads its text every step)."""
    runs: list[str] = []  # runs[i] is the content just before calls[i]; the last one, after them all
    calls: list[FunctionCall] = []
    run: list[str] = []
    position = 0
    while (start := text.find(TOOL_CALL_START, position)) >= 0:
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end < 0:
            break  # an unclosed block: content if the text ends here, held back if not
        run.append(text[position:start])
        body = text[start + len(TOOL_CALL_START):end]
        if parsed is None:
            call = parse_call_body(body, request)
        else:
            if body not in parsed:
                parsed[body] = parse_call_body(body, request)
            call = parsed[body]
        if call is None:
            run.append(text[start:end + len(TOOL_CALL_END)])
        else:
            runs.append("".join(run))
            run = []
            calls.append(call)
        position = end + len(TOOL_CALL_END)
    tail = text[position:]
    if not final:
        start = tail.find(TOOL_CALL_START)
        tail = tail[:start] if start >= 0 else tail[:len(tail) - partial_tag_length(tail)]
    run.append(tail)
    runs.append("".join(run))
    # A whitespace-only run is dropped next to a call (the newlines between
    # blocks); while the text may go on, one is held back, a call may follow.
    keep_blank = final and not calls
    pieces = [content for content in runs if keep_blank or not content.isspace()]
    return "".join(pieces), calls


class HermesToolParser(ToolParser):
    conformance_examples = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        'Let me check.\n<tool_call>{"name": "search", "arguments": {"query": "h\u00e9llo \\"w\\" <b>"}}</tool_call>',
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}\n</tool_call>\nBoth asked.',
        'Sure <tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call> and '
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{"name": "now", "arguments": {}}',
    )

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.num_content_chars_sent = 0
        self.num_calls_sent = 0
        self.parsed_bodies: dict[str, FunctionCall | None] = {}

    def extract_tool_calls(self, model_output: str, request: ToolRequest) -> ExtractedToolCalls:
        content, calls = split_tool_calls(model_output, request, final=True)
        return ExtractedToolCalls(tuple(calls), content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: ToolRequest
    ) -> ToolParserDelta | None:
        return self._release(current_text, request, final=False)

    def finish_streaming(self, current_text: str, request: ToolRequest) -> ToolParserDelta | None:
        return self._release(current_text, request, final=True)

    def _release(self, text: str, request: ToolRequest, final: bool) -> ToolParserDelta | None:
        content, calls = split_tool_calls(text, request, final, self.parsed_bodies)
        new_content = content[self.num_content_chars_sent:]
        pieces: list[DeltaFunctionCall] = []
        for index in range(self.num_calls_sent, len(calls)):
            pieces.append(DeltaFunctionCall(index, name=calls[index].name, arguments=""))
            pieces.append(DeltaFunctionCall(index, arguments=calls[index].arguments))
        self.num_content_chars_sent = len(content)
        self.num_calls_sent = len(calls)
        delta = ToolParserDelta(new_content or None, tuple(pieces))
        return None if delta.is_empty() else delta
