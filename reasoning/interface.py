"""The reasoning-parser plugin kind: split a reasoning model's output into
its reasoning section and its answer (``reasoning_content`` / ``content``).

Modeled on vLLM's ``ReasoningParser``. One parser instance is built per
tokenizer, ``ParserCls(tokenizer)``, and shared by every request: the methods
must keep no per-request state (streaming gets the whole text so far).

Two sides use it:

- the API server (chat completions): ``extract_reasoning_content`` on a
  finished reply, ``extract_reasoning_content_streaming`` on each delta;
- the engine core's structured output: ``is_reasoning_end`` over a request's
  token ids decides when its grammar starts to apply, and
  ``extract_content_ids`` says which of the tokens the grammar advances on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class DeltaReasoning:
    """What one streamed delta adds: reasoning text, answer text, or both
    (None: nothing of that kind)."""

    reasoning_content: str | None = None
    content: str | None = None


class ReasoningParser(ABC):
    """Splits reasoning from content. Registered under the plugin kind
    ``reasoning_parser``; selected by ``structured_output.reasoning_parser``
    (``--reasoning-parser NAME``)."""

    #: The tags that open and close the reasoning section: the conformance
    #: suite (pagedllm.testing.suites.reasoning_parser) scripts replies with them.
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """True when the reasoning section is over at the end of `token_ids`
        (a prompt, or a prompt's generated tokens so far): the tokens that
        follow are the answer, and a grammar applies to them."""

    @abstractmethod
    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The ids of `token_ids` that follow the end of reasoning (empty
        while it has not ended)."""

    @abstractmethod
    def extract_reasoning_content(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole reply; None for a part
        that is absent. `request` is the chat request (unused by the built-in)."""

    @abstractmethod
    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaReasoning | None:
        """What the delta adds (``current_text = previous_text + delta_text``);
        None when it adds nothing yet (e.g. a tag that may still be
        completing). Streamed deltas concatenated, plus the final flush the
        server makes from ``extract_reasoning_content``, equal the whole
        reply's split: the conformance suite checks it."""


__all__ = ["DeltaReasoning", "ReasoningParser"]
