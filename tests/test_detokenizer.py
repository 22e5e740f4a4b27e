"""IncrementalDetokenizer against tokenizer.decode on the project's byte-level BPE."""

from __future__ import annotations

import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.model_registry.tiny import get_tokenizer_dir

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_tokenizer_dir())


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (GPT-2): printable bytes map to themselves,
    the others to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split."""
    byte_to_char = gpt2_bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_to_char[b] for b in text.encode("utf-8")])


def test_multibyte_characters_split_bytewise_are_emitted_once_complete(tokenizer):
    text = "héllo 😀 中文 🎉ok"
    ids = byte_token_ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[5, 6])
    deltas = [detok.update([token_id]) for token_id in ids]
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == text == detok.output_text
    # 😀 is 4 bytes: nothing for its first 3 byte tokens, then the whole character.
    start = len("héllo ".encode())
    assert deltas[start : start + 4] == ["", "", "", "😀"]
    # 中 is 3 bytes.
    start = len("héllo 😀 ".encode())
    assert deltas[start : start + 3] == ["", "", "中"]


def test_encoded_text_streamed_token_by_token_matches_decode(tokenizer):
    text = 'def grüße(name: str) -> str:\n    return f"こんにちは {name} 👋🏽"\n'
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([token_id]) for token_id in ids]
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == text
    assert detok.flush() == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_end_equal_to_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    vocab_size = len(tokenizer)
    for _ in range(40):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))]
        # Lone byte tokens (ids 5..260) make incomplete and invalid UTF-8 likely.
        ids += [rng.randrange(5, 261) for _ in range(rng.randrange(0, 6))]
        rng.shuffle(ids)
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
        pos, text = 0, ""
        while pos < len(ids):
            chunk = rng.randrange(1, 4)
            text += detok.update(ids[pos : pos + chunk])
            pos += chunk
        text += detok.flush()
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert text == detok.output_text == expected, ids


def test_special_tokens_skipped_or_kept(tokenizer):
    hello = tokenizer.encode("Hello")
    eos = tokenizer.eos_token_id
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [im_start, *hello, eos]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skipped.update([t]) for t in ids) == "Hello"
    assert "".join(kept.update([t]) for t in ids) == "<|im_start|>Hello<|eos|>"


def test_trailing_incomplete_character_is_held_until_flush(tokenizer):
    ids = byte_token_ids(tokenizer, "ok😀")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update(ids) == "ok"
    assert detok.flush() == tokenizer.decode(ids)[2:] == REPLACEMENT_CHAR
    assert detok.output_text == tokenizer.decode(ids)
