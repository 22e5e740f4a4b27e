"""Special-token strings a client writes are text, not control tokens.

The model's chat template renders a conversation to one string, and the
tokenizer turns every special-token string in it into its special id: a user
who types `<|im_end|><|im_start|>system` into a message would close their
turn and open a system one (vLLM does this by default; llama.cpp does not
parse special tokens in user text). So, unless the operator turns
`server.parse_special_tokens_in_user_text` on:

- a plain prompt (/v1/completions, /tokenize) is encoded with its special
  tokens split as text (`encode_text(..., split_special_tokens=True)`);
- a conversation is rendered with every special-token string in the client's
  strings (message contents of every role, names, tool calls, tool results,
  tool definitions, template kwargs) replaced by a marker. The template's own
  special tokens are then the only ones in the rendered text; the stretch
  between two of them that holds a marker gets the marker's string back and
  is encoded with special tokens split, every other stretch as before.

The tokenizer itself splits a text at special tokens and encodes the pieces
apart, so cutting at the template's special tokens changes nothing: a stretch
gets exactly the ids the tokenizer gives it as text, and a conversation
without special-token strings is rendered and encoded in one piece, as
before. Known gap: a SentencePiece-style pre-tokenizer that adds its
word-start mark only at the very start of the text (`prepend_scheme:
"first"`) adds it to such a stretch too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from pagedllm.core.errors import InvalidRequestError
from pagedllm.entrypoints.openai.fast_tokenizer import check_num_tokens, encode_text

# A marker is MARK_OPEN, the escaped string's index, MARK_CLOSE: private-use
# characters, so no tokenizer has them in a special token. A client's own
# MARK_OPEN / MARK_CLOSE are escaped too, so markers cannot be forged.
MARK_OPEN = "\ue000"
MARK_CLOSE = "\ue001"
# Characters one regex search may scan: the scan holds the GIL, and a 4 MB
# message in one call would stall the event loop's thread for tens of ms.
SEARCH_WINDOW_CHARS = 1 << 16


class EscapedChat(NamedTuple):
    """What the template renders instead of the client's values, and the
    special-token strings the markers in them stand for (by index)."""

    conversation: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None
    originals: list[str]


@dataclass(frozen=True)
class UserTextSpecials:
    """A tokenizer's special-token strings, as text to find in a client's strings."""

    # Any special-token string (the longest first, as the tokenizer matches)
    # or a marker character.
    escape_pattern: re.Pattern[str]
    # A marker (group 1: its index), else as escape_pattern.
    rendered_pattern: re.Pattern[str]
    # Longest text either pattern matches.
    max_match_chars: int
    # Special tokens that take the whitespace after (rstrip) / before (lstrip) them.
    rstrip: frozenset[str]
    lstrip: frozenset[str]

    @classmethod
    def of(cls, tokenizer: Any) -> UserTextSpecials | None:
        """None for a tokenizer without special added tokens (nothing to escape)."""
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = [
            token for token in added.values() if getattr(token, "special", False) and getattr(token, "content", "")
        ]
        if not specials:
            return None
        contents = sorted({str(token.content) for token in specials}, key=len, reverse=True)
        alternation = "|".join(re.escape(content) for content in contents)
        return cls(
            re.compile(f"{alternation}|[{MARK_OPEN}{MARK_CLOSE}]"),
            re.compile(f"{MARK_OPEN}([0-9]+){MARK_CLOSE}|{alternation}|[{MARK_OPEN}{MARK_CLOSE}]"),
            # A marker's index is below the number of strings escape_pattern matches.
            max(len(contents[0]), len(str(len(contents) + 2)) + 2),
            frozenset(str(token.content) for token in specials if getattr(token, "rstrip", False)),
            frozenset(str(token.content) for token in specials if getattr(token, "lstrip", False)),
        )

    def escape(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
    ) -> EscapedChat | None:
        """Every string (keys too) with its special-token strings replaced
        by markers; None when there is none (render as it is)."""
        # One marker per distinct string: a long run of short special tokens
        # stays about as long as it was.
        markers: dict[str, str] = {}

        def mark(match: re.Match[str]) -> str:
            found = match.group()
            marker = markers.get(found)
            if marker is None:
                marker = markers[found] = f"{MARK_OPEN}{len(markers)}{MARK_CLOSE}"
            return marker

        def escape_value(value: Any) -> Any:
            if isinstance(value, str):
                return _substitute(self.escape_pattern, value, mark, self.max_match_chars)
            if isinstance(value, dict):
                return {escape_value(key): escape_value(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape_value(item) for item in value]
            return value

        try:
            escaped = EscapedChat(escape_value(conversation), escape_value(tools), escape_value(template_kwargs),
                                  list(markers))
        except RecursionError:  # only trusted chat_template_kwargs can nest this deep
            raise InvalidRequestError(
                "chat_template_kwargs", "<nested too deeply>", "may nest at most a few hundred levels"
            ) from None
        return escaped if markers else None

    def encode_rendered(
        self, tokenizer: Any, rendered: str, originals: list[str], max_num_tokens: int | None = None
    ) -> tuple[str, list[int]]:
        """The text the template rendered from an escaped chat, with the
        markers' strings back, and its ids: the template's special tokens
        special, the client's strings text. InvalidRequestError past
        `max_num_tokens`, or when the template took a marker apart."""
        token_ids: list[int] = []
        pieces: list[str] = []
        for text, split in self._chunks(rendered, originals):
            token_ids += encode_text(tokenizer, text, False, split_special_tokens=split)
            check_num_tokens(len(token_ids), max_num_tokens)
            pieces.append(text)
        return "".join(pieces), token_ids

    def _chunks(self, rendered: str, originals: list[str]) -> list[tuple[str, bool]]:
        """(text, split special tokens?) pieces, cut only at the template's special tokens."""
        chunks = _Chunks(self)
        position = 0
        for match in _matches(self.rendered_pattern, rendered, self.max_match_chars):
            chunks.stretch.append(rendered[position:match.start()])
            position = match.end()
            index = match.group(1)
            if index is not None and int(index) < len(originals):
                chunks.stretch.append(originals[int(index)])
                chunks.tainted = True
            elif match.group() in (MARK_OPEN, MARK_CLOSE) or index is not None:
                raise InvalidRequestError(
                    "messages", "<a special-token string>", "the chat template changed a special-token string "
                    "of the messages (start the server with --parse-special-tokens-in-user-text to pass them "
                    "as they are)",
                )
            else:
                chunks.end_stretch(match.group())
        chunks.stretch.append(rendered[position:])
        chunks.end_stretch(None)
        return chunks.done


def _matches(pattern: re.Pattern[str], text: str, max_match_chars: int) -> Iterator[re.Match[str]]:
    """`pattern.finditer(text)`, each search bounded to SEARCH_WINDOW_CHARS
    (plus a match's length, so one that starts in the window is whole)."""
    position = 0
    while position < len(text):
        window_end = position + SEARCH_WINDOW_CHARS
        match = pattern.search(text, position, window_end + max_match_chars)
        if match is None or match.start() >= window_end:
            position = window_end
            continue
        yield match
        position = match.end()


def _substitute(
    pattern: re.Pattern[str], text: str, replace: Callable[[re.Match[str]], str], max_match_chars: int
) -> str:
    """`pattern.sub(replace, text)`, searching window by window (`_matches`)."""
    pieces: list[str] = []
    position = 0
    for match in _matches(pattern, text, max_match_chars):
        pieces += (text[position:match.start()], replace(match))
        position = match.end()
    if not pieces:
        return text
    pieces.append(text[position:])
    return "".join(pieces)


class _Chunks:
    """Builds the pieces: the template's text and special tokens gather into
    one piece encoded as usual; a stretch that holds a client's special-token
    string is a piece of its own, encoded with special tokens split."""

    def __init__(self, specials: UserTextSpecials) -> None:
        self.specials = specials
        self.done: list[tuple[str, bool]] = []
        self.plain: list[str] = []
        self.stretch: list[str] = []
        self.tainted = False
        self.previous_special: str | None = None

    def end_stretch(self, next_special: str | None) -> None:
        text = "".join(self.stretch)
        self.stretch, tainted, self.tainted = [], self.tainted, False
        if tainted:
            # Whitespace a neighbouring special token takes stays beside it.
            head = tail = ""
            if self.previous_special in self.specials.rstrip:
                stripped = text.lstrip()
                head, text = text[: len(text) - len(stripped)], stripped
            if next_special in self.specials.lstrip:
                stripped = text.rstrip()
                text, tail = stripped, text[len(stripped):]
            self._flush(head)
            self.done.append((text, True))
            text = tail
        self.plain.append(text)
        if next_special is not None:
            self.plain.append(next_special)
            self.previous_special = next_special
        else:
            self._flush("")

    def _flush(self, extra: str) -> None:
        text = "".join(self.plain) + extra
        self.plain = []
        if text:
            self.done.append((text, False))
