"""Structured output after reasoning: a request's grammar applies only once
its reasoning section has ended (vLLM's `reasoner.is_reasoning_end` in its
StructuredOutputManager).

The gate asks the configured reasoning parser (plugin kind
``reasoning_parser``, looked up by name) about token ids only, so the engine
core never detokenizes for it. The parser is built on first use, with the
tokenizer the grammar backends use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.reasoning.select import build_reasoning_parser

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.reasoning.interface import ReasoningParser


class ReasoningGate:
    def __init__(self, parser_name: str | None, tokenizer: Callable[[], Any]) -> None:
        self.parser_name = parser_name
        self._tokenizer = tokenizer
        self._parser: ReasoningParser | None = None

    @property
    def parser(self) -> ReasoningParser | None:
        if self._parser is None and self.parser_name is not None:
            self._parser = build_reasoning_parser(self.parser_name, self._tokenizer())
        return self._parser

    def ended_in_prompt(self, request: Request) -> bool:
        """Whether a new request starts past its reasoning: no parser, or a
        prompt that closed the section itself (a template's "thinking off"
        `<think></think>`)."""
        parser = self.parser
        return parser is None or parser.is_reasoning_end(request.prompt_token_ids)

    def content_ids(self, output_token_ids: Sequence[int]) -> list[int] | None:
        """The output tokens after the end of reasoning; None while it goes on."""
        parser = self.parser
        if parser is None:
            return list(output_token_ids)
        if not parser.is_reasoning_end(output_token_ids):
            return None
        return parser.extract_content_ids(output_token_ids)

    def num_free_rows(self, output_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> int:
        """Of a still-reasoning request's 1 + len(drafts) sampled positions
        (row j follows the first j drafts), how many come before the end of
        reasoning: they sample unconstrained. A draft may end it; the rows
        after that one follow the grammar."""
        parser = self.parser
        if parser is None:
            return 0
        context = list(output_token_ids)
        for position in range(len(draft_token_ids) + 1):
            if parser.is_reasoning_end(context):
                return position
            if position < len(draft_token_ids):
                context.append(draft_token_ids[position])
        return len(draft_token_ids) + 1


__all__ = ["ReasoningGate"]
