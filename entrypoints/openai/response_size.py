"""The bound on a non-streaming response's size, checked before generation.

A non-streaming body is built whole in the API process, so its size is
memory the server must have: `server.max_response_bytes` bounds it. The
estimate is the worst case the request allows: every one of its `n`
choices runs to `max_tokens` (or the context left), and every token, its
logprob entries and their alternatives, is the longest JSON text any
single token of the vocabulary decodes to. A request over the bound gets a
400 naming the fields and the numbers before any of its prompts is
scheduled; a streamed response is written as it is made and is not bounded.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIServingError

# What a choice carries beyond its tokens' text: keys, index, finish and
# stop reasons, the message's role (a stop string is at most 1 KiB).
CHOICE_BYTES = 1280
# A float as JSON (-1.2345678901234567e-05) with its separator.
FLOAT_BYTES = 25
# A text offset (an int) with its separator.
OFFSET_BYTES = 12
# Keys and punctuation of one chat logprob entry:
# {"token":"","logprob":,"bytes":[],"top_logprobs":[]},
CHAT_ENTRY_BYTES = 52
# Each byte of a chat logprob's `bytes` list: up to three digits and a comma.
BYTES_PER_TOKEN_BYTE = 4


# tokenizer -> its max_token_json_bytes, measured once per tokenizer.
_token_bytes: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_token_bytes_lock = threading.Lock()


def max_token_json_bytes(tokenizer: Any) -> int:
    """The longest JSON text (escaped, without its quotes) that any single
    token of `tokenizer` decodes to; measured on first use (blocking: about
    40 ms for 8k tokens, 0.5-1 s for a 150k vocabulary), then remembered."""
    with _token_bytes_lock:
        cached = _token_bytes.get(tokenizer)
        if cached is None:
            texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
            cached = max((len(json.dumps(text, ensure_ascii=False).encode()) - 2 for text in texts), default=1)
            _token_bytes[tokenizer] = cached
        return cached


def completion_token_bytes(token_bytes: int, num_logprobs: int | None) -> int:
    """The most JSON one token of a /v1/completions choice can take: its
    text, and with `logprobs=k` its entries in tokens, token_logprobs,
    text_offset and a top_logprobs dict of k + 1 tokens."""
    size = token_bytes
    if num_logprobs is not None:
        size += (token_bytes + 3) + FLOAT_BYTES + OFFSET_BYTES + 2
        size += (num_logprobs + 1) * (token_bytes + 4 + FLOAT_BYTES)
    return size


def chat_token_bytes(token_bytes: int, num_top_logprobs: int | None) -> int:
    """The most JSON one token of a chat choice can take: its text (twice,
    in case it lands in a tool call's escaped arguments) and with logprobs
    one entry plus `top_logprobs` alternatives, each with its bytes list."""
    size = 2 * token_bytes
    if num_top_logprobs is not None:
        entry = CHAT_ENTRY_BYTES + token_bytes + FLOAT_BYTES + BYTES_PER_TOKEN_BYTE * token_bytes
        size += (1 + num_top_logprobs) * entry
    return size


def check_response_size(estimate: int, limit: int, detail: str, param: str) -> None:
    """400 naming the request's fields when its worst-case body `estimate`
    exceeds `limit` (server.max_response_bytes)."""
    if estimate > limit:
        raise OpenAIServingError(
            400, f"{param}: the response to this request could reach {estimate} bytes ({detail}), more than "
            f"server.max_response_bytes = {limit}; lower n, max_tokens or logprobs, or stream the response "
            "(stream: true)", param,
        )
