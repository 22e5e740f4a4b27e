"""The tool-call parser interface (vLLM's ``ToolParser``, typed and smaller).

A parser reads what the model wrote and splits it into plain ``content`` and
function calls. The server builds one parser per choice of a request (so a
parser may keep state between streaming calls), selected by
``--tool-call-parser NAME`` and used only when the request's ``tool_choice``
is ``auto`` and the server runs with ``--enable-auto-tool-choice``.

Contract (checked by the conformance suite, pagedllm.testing.suites.tool_parser):
for any text, however it is cut into deltas, the content streamed by
``extract_tool_calls_streaming`` (plus ``finish_streaming``) concatenates to
the ``content`` of ``extract_tool_calls`` ("" for None), and the calls it
streams equal its ``tool_calls``; no part of a call's markup ever reaches
content unless the call is given up as malformed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolSpec:
    """One function offered in the request's ``tools``."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)  # its JSON schema
    description: str | None = None


@dataclass(frozen=True)
class ToolRequest:
    """What a parser may read of the request: the tools offered."""

    tools: tuple[ToolSpec, ...] = ()

    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)


@dataclass(frozen=True)
class FunctionCall:
    """A complete call: ``arguments`` is JSON text (an object), as OpenAI sends it."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """The whole output split: its calls, and the text left as content (None when none)."""

    tool_calls: tuple[FunctionCall, ...] = ()
    content: str | None = None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(frozen=True)
class DeltaFunctionCall:
    """A piece of the call at ``index`` (0, 1, ... in output order): its first
    piece carries ``name``; later pieces append to ``arguments``."""

    index: int
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class ToolParserDelta:
    """What one streaming step releases: content first, then call pieces."""

    content: str | None = None
    tool_calls: tuple[DeltaFunctionCall, ...] = ()

    def is_empty(self) -> bool:
        return not self.content and not self.tool_calls


class ToolParser(abc.ABC):
    """Splits model output into content and tool calls. Built as
    ``ParserCls(tokenizer)``, once per choice of a request."""

    # Model outputs in this parser's format, each with at least one call of the
    # conformance suite's tools (``get_weather``, ``search``, ``now``: see
    # pagedllm.testing.suites.tool_parser); the suite streams them cut every way.
    conformance_examples: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def extract_tool_calls(self, model_output: str, request: ToolRequest) -> ExtractedToolCalls:
        """The whole output at once (non-streaming responses)."""

    @abc.abstractmethod
    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: ToolRequest
    ) -> ToolParserDelta | None:
        """One step of a stream: ``current_text == previous_text + delta_text``.
        Returns what may be sent now (None: nothing yet). Text that might
        still turn out to be markup is held back, never sent as content."""

    def finish_streaming(self, current_text: str, request: ToolRequest) -> ToolParserDelta | None:
        """The stream has ended with ``current_text``: release whatever was
        held back (a partial tag that never completed, an unclosed call)."""
        return None
