"""Incremental detokenization that never emits half a character.

Byte-level BPE splits a multi-byte UTF-8 character (emoji, CJK) across
tokens; decoding a prefix that ends mid-character yields U+FFFD. Like vLLM's
prefix_offset / read_offset scheme, we decode a small window of tokens
[prefix_offset, end) and emit only the part past the already-emitted
[prefix_offset, read_offset) text, holding it back while it ends in U+FFFD.
Decoding a window starting at a boundary where the text was complete gives
the same characters as decoding the whole sequence, so the emitted deltas
concatenate to `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Tokens before the decode window are dropped once this many gathered.
TRIM_AFTER = 64


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens step by step.

    `prompt_token_ids` is accepted for vLLM parity; the output text is the
    decode of the output tokens alone. `spaces_between_special_tokens` only
    matters to slow (Python) tokenizers; fast ones ignore it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # The Rust tokenizer decodes without transformers' per-call overhead.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode_fn = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode_fn = lambda ids: tokenizer.decode(
                ids,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        self.token_ids: list[int] = []
        self.output_text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly finalized text (possibly empty)."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        # Emit up to the last new token at which the text is complete; with
        # several new tokens (speculative decoding) only the tail may wait.
        end = len(self.token_ids)
        while end > self.read_offset:
            window_text = self._decode_fn(self.token_ids[self.prefix_offset : end])
            if len(window_text) > len(self._prefix_text) and not window_text.endswith(REPLACEMENT_CHAR):
                break
            end -= 1
        else:
            return ""  # mid-character (or nothing visible yet): wait for more tokens
        delta = window_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self._prefix_text = self._decode_fn(self.token_ids[self.prefix_offset : self.read_offset])
        self.output_text += delta
        if self.prefix_offset >= TRIM_AFTER:
            self._trim()
        return delta

    def _trim(self) -> None:
        """Forget the tokens before the window: no decode reads them again,
        and a long request's whole token list would otherwise be held (and
        scanned by the garbage collector) once more here."""
        del self.token_ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0

    def flush(self) -> str:
        """Emit whatever is held back (call when the request finishes): a
        sequence that ended mid-character decodes with U+FFFD, as decode() does."""
        if self.read_offset == len(self.token_ids):
            return ""
        window_text = self._decode_fn(self.token_ids[self.prefix_offset :])
        delta = window_text[len(self._prefix_text) :]
        self.token_ids.clear()
        self.prefix_offset = self.read_offset = 0
        self._prefix_text = ""
        self.output_text += delta
        return delta
