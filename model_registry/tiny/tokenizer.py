"""Byte-level BPE tokenizer trained by project code on the train split of the
Python standard library sources (see `corpus.py`; the training code is
`training/tiny/tokenizer.py` in a checkout, not installed).

Choices:
- 8,192 tokens: 5 special tokens (ids 0-4), the 256 byte symbols, merges.
- No BOS is added by the post-processor: `encode(text)` is exactly the text's
  tokens (as Qwen/ChatML tokenizers do), so prompts round-trip and the chat
  template alone decides the framing. `<|bos|>` exists for models that want it.
- `clean_up_tokenization_spaces` is off, so `decode(encode(text)) == text`.
- Source text is encoded with the `tokenizers` flag `encode_special_tokens`
  on (`source_encoder()`): a literal `<|im_start|>` or `<|eos|>` in a file of
  the corpus stays text, so the models never learn the markers from code.
  The saved tokenizer keeps the flag off (transformers' `split_special_tokens`
  false), as every chat tokenizer does: a chat template rendered to text and
  encoded, in transformers, vLLM or pagedllm, gives the marker tokens.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

VOCAB_SIZE = 8192
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# NOTE: order fixes the ids (0..4); the default model's config relies on it.
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
MODEL_MAX_LENGTH = 2048


def chat_template() -> str:
    return resources.files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")


def source_encoder(tokenizer_dir: Path) -> Tokenizer:
    """The saved tokenizer, set to encode special-token strings as plain text
    (for corpus files; not for rendered chat prompts)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    return tokenizer


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Special token -> id, read from a saved tokenizer.json."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return {entry["content"]: entry["id"] for entry in data["added_tokens"]}
