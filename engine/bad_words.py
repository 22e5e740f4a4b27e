"""bad_words as token ids (vLLM's SamplingParams.update_from_tokenizer).

A word is tokenized as it is written (leading spaces stripped) and, to ban it
in the middle of a text too, with one leading space when that gives another
first token and as many tokens (a tokenizer that merges the space into the
word's first token: " Paris" vs "Paris"). The sampler bans a sequence's last
token whenever the tokens before it are the last ones generated.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import InvalidRequestError


def bad_words_token_ids(tokenizer: Any, bad_words: list[str], vocab_size: int) -> list[list[int]]:
    """The token-id sequences `bad_words` ban; InvalidRequestError naming
    `bad_words` when one holds a token id past the vocabulary."""
    sequences: list[list[int]] = []
    for word in bad_words:
        word = word.lstrip()
        plain = list(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            continue
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    for sequence in sequences:
        for token_id in sequence:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError("bad_words", token_id,
                                          f"a word tokenizes to an id outside the vocabulary [0, {vocab_size})")
    return sequences
