"""The mistral_json parser: exact splits, found through the entry point
(its conformance suite runs in test_conformance.py)."""

from __future__ import annotations

import pytest

from pagedllm.plugins import get_plugin_manager
from pagedllm.tool_parsers.base import ToolRequest, ToolSpec
from pagedllm_example_toolparser.parser import MistralJsonToolParser

REQUEST = ToolRequest((ToolSpec("get_weather"), ToolSpec("now")))


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("no calls here", "no calls here", []),
    ('Sure.[TOOL_CALLS][{"name": "now", "arguments": {}}]', "Sure.", [("now", "{}")]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now"}]', None,
     [("get_weather", '{"city": "Oslo"}'), ("now", "{}")]),
    # not calls: cut, unknown tool, not an array; all given back as written
    ('x[TOOL_CALLS][{"name": "now"', 'x[TOOL_CALLS][{"name": "now"', []),
    ('[TOOL_CALLS][{"name": "rm", "arguments": {}}]', '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', []),
    ('[TOOL_CALLS]{"name": "now"}', '[TOOL_CALLS]{"name": "now"}', []),
])
def test_splits_calls_from_content(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    result = MistralJsonToolParser(None).extract_tool_calls(text, REQUEST)
    assert (result.content, [(c.name, c.arguments) for c in result.tool_calls]) == (content, calls)


def test_found_through_the_entry_point() -> None:
    registration = get_plugin_manager().tool_parsers.get("mistral_json")
    assert registration.source.startswith("pagedllm-example-toolparser ")
