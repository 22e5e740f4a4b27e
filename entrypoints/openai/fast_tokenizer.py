"""Tokenizing and detokenizing long inputs in a worker thread without
stalling the event loop: a fast tokenizer's batch calls release the GIL,
its single-text calls (and transformers' wrappers around them) hold it or
build far more than the ids. Same results as `tokenizer.encode` /
`tokenizer.decode`; other tokenizers go through those unchanged."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from pagedllm.core.errors import InvalidRequestError

# Per tokenizer, a copy of its fast backend that encodes special-token
# strings as text (`tokenizers`' encode_special_tokens). A copy, because
# transformers' `split_special_tokens=True` flips that flag on the shared
# backend for the call: another thread's encode would then split too.
_split_special_backends: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_split_special_backends_lock = threading.Lock()


def encode_text(
    tokenizer: Any, text: str, add_special_tokens: bool, max_num_tokens: int | None = None,
    split_special_tokens: bool = False,
) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, without building the
    offsets and token strings of a full Encoding when the tokenizer is a fast
    one with nothing that call would change first (truncation, padding,
    split special tokens): for a 3.9 MB prompt 1.9 s instead of 5.3 s, and
    200 MB less at the peak. Blocking; releases the GIL while it works.

    `split_special_tokens`: special-token strings in `text` are encoded as
    the text they are (transformers' `split_special_tokens=True`); the ids
    `add_special_tokens` adds (a BOS) are still the special ones.

    A text of more than `max_num_tokens` tokens is refused before its ids
    become Python ints (1.4 million of them held the GIL for 0.1 s)."""
    if split_special_tokens and not getattr(tokenizer, "split_special_tokens", False):
        return _encode_split_special(tokenizer, text, add_special_tokens, max_num_tokens)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode_fast = getattr(backend, "encode_batch_fast", None)
    if (
        backend is None or encode_fast is None or getattr(tokenizer, "split_special_tokens", False)
        or backend.truncation is not None or backend.padding is not None
    ):
        token_ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        check_num_tokens(len(token_ids), max_num_tokens)
        return token_ids
    encoding = encode_fast([text], add_special_tokens=add_special_tokens)[0]
    check_num_tokens(len(encoding), max_num_tokens)
    fast_token_ids: list[int] = encoding.ids
    return fast_token_ids


def _encode_split_special(
    tokenizer: Any, text: str, add_special_tokens: bool, max_num_tokens: int | None
) -> list[int]:
    backend = split_special_backend(tokenizer)
    if backend is None:  # a slow tokenizer: the flag is per call there
        token_ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))
        check_num_tokens(len(token_ids), max_num_tokens)
        return token_ids
    encoding = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    check_num_tokens(len(encoding), max_num_tokens)
    split_token_ids: list[int] = encoding.ids
    return split_token_ids


def split_special_backend(tokenizer: Any) -> Any | None:
    """The tokenizer's fast backend copied once, with `encode_special_tokens`
    on and no truncation or padding (as `tokenizer.encode` calls it); None
    for a tokenizer without a fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    with _split_special_backends_lock:
        split_backend = _split_special_backends.get(tokenizer)
        if split_backend is None:
            from tokenizers import Tokenizer

            split_backend = Tokenizer.from_str(backend.to_str())
            split_backend.no_truncation()
            split_backend.no_padding()
            split_backend.encode_special_tokens = True
            _split_special_backends[tokenizer] = split_backend
    return split_backend


def check_num_tokens(num_tokens: int, max_num_tokens: int | None) -> None:
    if max_num_tokens is not None and num_tokens > max_num_tokens:
        # NOTE: the words of core.engine.validate_prompt, which checks the same.
        max_model_len = max_num_tokens + 1
        raise InvalidRequestError(
            "prompt", f"<{num_tokens} tokens>", f"the prompt has {num_tokens} tokens but max_model_len is "
            f"{max_model_len} and at least one token must be generated",
        )


def decode_tokens(tokenizer: Any, token_ids: list[int]) -> str:
    """`tokenizer.decode(token_ids)` through the fast tokenizer's
    decode_batch, which releases the GIL (decode holds it, and transformers
    first walks the list in Python: a million ids stalled the event loop for
    0.4 s from a worker thread). Blocking."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode_batch = getattr(backend, "decode_batch", None)
    if decode_batch is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return str(tokenizer.decode(token_ids))
    text: str = decode_batch([token_ids], skip_special_tokens=False)[0]
    return text
