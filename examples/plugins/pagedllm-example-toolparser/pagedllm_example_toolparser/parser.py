"""``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}``."""

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

MARKER = "[TOOL_CALLS]"


def read_calls(array_text: str, request: ToolRequest) -> list[FunctionCall] | None:
    """The calls of the text after the marker, or None unless all of it is one valid array."""
    try:
        items = json.loads(array_text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        arguments = item.get("arguments", {}) if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in request.names() or not isinstance(arguments, dict):
            return None
        calls.append(FunctionCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def held_marker_length(text: str) -> int:
    """Length of the end of ``text`` that could still grow into the marker."""
    for length in range(min(len(MARKER) - 1, len(text)), 0, -1):
        if text.endswith(MARKER[:length]):
            return length
    return 0


class MistralJsonToolParser(ToolParser):
    conformance_examples = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        'Let me check.[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "search", '
        '"arguments": {"query": "x [TOOL_CALLS] y"}}]',
    )

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.num_content_chars_sent = 0

    def extract_tool_calls(self, model_output: str, request: ToolRequest) -> ExtractedToolCalls:
        before, marker, after = model_output.partition(MARKER)
        calls = read_calls(after, request) if marker else None
        if calls is None:
            return ExtractedToolCalls((), model_output or None)
        return ExtractedToolCalls(tuple(calls), before or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: ToolRequest
    ) -> ToolParserDelta | None:
        # Up to the marker (or a partial one) the text is content; after it,
        # nothing is known until the stream ends.
        before, marker, _ = current_text.partition(MARKER)
        safe = before if marker else before[:len(before) - held_marker_length(before)]
        return self._content_up_to(safe)

    def finish_streaming(self, current_text: str, request: ToolRequest) -> ToolParserDelta | None:
        result = self.extract_tool_calls(current_text, request)
        pieces: list[DeltaFunctionCall] = []
        for index, call in enumerate(result.tool_calls):
            pieces += [DeltaFunctionCall(index, name=call.name, arguments=""),
                       DeltaFunctionCall(index, arguments=call.arguments)]
        content = self._content_up_to(result.content or "")
        delta = ToolParserDelta(content.content if content else None, tuple(pieces))
        return None if delta.is_empty() else delta

    def _content_up_to(self, content: str) -> ToolParserDelta | None:
        new = content[self.num_content_chars_sent:]
        self.num_content_chars_sent = max(self.num_content_chars_sent, len(content))
        return ToolParserDelta(new) if new else None
