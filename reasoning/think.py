"""The built-in ``think`` parser (vLLM's ``deepseek_r1``): reasoning between
``<think>`` and ``</think>``.

- The start tag is optional: templates of DeepSeek-R1-style models open
  ``<think>`` in the prompt, so a reply may begin inside the reasoning.
- No end tag: the whole reply is reasoning (it was cut short, or never ended).
- Streaming holds back a tail that may still become a tag (``</th``), so a
  tag split across deltas never leaks into either field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.reasoning.interface import DeltaReasoning, ReasoningParser


def _find_subsequence(token_ids: Sequence[int], pattern: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of `pattern` in `token_ids` at or after `start`; -1 if none."""
    if not pattern:
        return -1
    first = pattern[0]
    width = len(pattern)
    ids = list(token_ids)
    index = start
    while True:
        try:
            index = ids.index(first, index)
        except ValueError:
            return -1
        if ids[index : index + width] == list(pattern):
            return index
        index += 1


def _rfind_subsequence(token_ids: Sequence[int], pattern: Sequence[int]) -> int:
    found, index = -1, _find_subsequence(token_ids, pattern)
    while index >= 0:
        found, index = index, _find_subsequence(token_ids, pattern, index + 1)
    return found


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ThinkReasoningParser(ReasoningParser):
    # The interface's default tags, <think> and </think>; a subclass may set others.

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        # Usually one added token each; a tokenizer without them spells the
        # tags in several tokens, which the id checks match as a sequence.
        self.start_token_ids: list[int] = list(tokenizer.encode(self.start_tag, add_special_tokens=False))
        self.end_token_ids: list[int] = list(tokenizer.encode(self.end_tag, add_special_tokens=False))

    # ---- token ids (the engine core's structured output) -------------------

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        if len(self.end_token_ids) == 1 and self.end_token_ids[0] not in token_ids:
            return False  # the common case, at C speed: still reasoning
        end = _rfind_subsequence(token_ids, self.end_token_ids)
        # A start tag after the last end tag (a prompt whose earlier turn
        # reasoned, then a template that opens a new section) reopens it.
        return end >= 0 and _rfind_subsequence(token_ids, self.start_token_ids) < end

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        end = _find_subsequence(token_ids, self.end_token_ids)
        return [] if end < 0 else list(token_ids[end + len(self.end_token_ids) :])

    # ---- text (the API server) ---------------------------------------------

    def _split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, content or None before the end tag). Not `final`: a
        tail that may still grow into a tag is left out of both."""
        if text.startswith(self.start_tag):
            text = text[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(text):
            return "", None
        reasoning, tag, content = text.partition(self.end_tag)
        if tag:
            return reasoning, content
        if not final:
            reasoning = reasoning[: len(reasoning) - _partial_tag_suffix(reasoning, self.end_tag)]
        return reasoning, None

    def extract_reasoning_content(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        reasoning, content = self._split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaReasoning | None:
        # Stateless: the split of the text so far minus the split of the text
        # before, so any cut of the stream gives the same whole.
        old_reasoning, old_content = self._split(previous_text, final=False)
        new_reasoning, new_content = self._split(current_text, final=False)
        reasoning_delta = new_reasoning[len(old_reasoning) :]
        content_delta = (new_content or "")[len(old_content or "") :]
        if not reasoning_delta and not content_delta:
            return None
        return DeltaReasoning(reasoning_delta or None, content_delta or None)


__all__ = ["ThinkReasoningParser"]
