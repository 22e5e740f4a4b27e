"""Chat replies through the server's reasoning parser
(``--reasoning-parser``): ``reasoning_content`` split from ``content``, in
whole replies and in streamed deltas.

The parser itself is a plugin (kind ``reasoning_parser``); this module is
the server's bookkeeping around it: per streamed choice, the text and token
ids so far, and a last flush so that the streamed pieces always add up to
the whole reply's split (a tail held back as a possible tag is sent at the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.reasoning.interface import DeltaReasoning
from pagedllm.reasoning.select import build_reasoning_parser

if TYPE_CHECKING:
    from pagedllm.reasoning.interface import ReasoningParser


def server_reasoning_parser(engine: Any) -> ReasoningParser | None:
    """The parser `engine`'s config names, over its tokenizer (None if none)."""
    config = getattr(engine, "config", None)
    name = None if config is None else config.structured_output.reasoning_parser
    return build_reasoning_parser(name, engine.tokenizer)


def split_reply(parser: ReasoningParser | None, text: str, request: Any = None) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished reply."""
    if parser is None:
        return None, text
    return parser.extract_reasoning_content(text, request)


@dataclass
class ReasoningStream:
    """One streamed choice's reasoning split."""

    parser: ReasoningParser
    request: Any = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sent_reasoning: str = ""
    sent_content: str = ""

    def delta(self, delta_text: str, delta_token_ids: list[int], finished: bool) -> DeltaReasoning | None:
        """What to send for one delta of the reply; `finished` flushes what
        the parser held back (so the stream equals the whole reply's split)."""
        previous_text, previous_ids = self.text, self.token_ids
        self.text = previous_text + delta_text
        self.token_ids = previous_ids + list(delta_token_ids)
        piece = None
        if delta_text or delta_token_ids:
            piece = self.parser.extract_reasoning_content_streaming(
                previous_text, self.text, delta_text, previous_ids, self.token_ids, list(delta_token_ids)
            )
        reasoning = piece.reasoning_content or "" if piece is not None else ""
        content = piece.content or "" if piece is not None else ""
        if finished:
            whole_reasoning, whole_content = self.parser.extract_reasoning_content(self.text, self.request)
            reasoning = (whole_reasoning or "")[len(self.sent_reasoning) :]
            content = (whole_content or "")[len(self.sent_content) :]
        self.sent_reasoning += reasoning
        self.sent_content += content
        if not reasoning and not content:
            return None
        return DeltaReasoning(reasoning or None, content or None)


__all__ = ["ReasoningStream", "server_reasoning_parser", "split_reply"]
