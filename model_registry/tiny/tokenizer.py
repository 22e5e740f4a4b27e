"""Byte-level BPE tokenizer trained by project code on the train split of the
Python standard library sources (see `corpus.py`).

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


def train_tokenizer(out_dir: Path) -> None:
    """Train the BPE tokenizer on the corpus's train split and save
    transformers-loadable files in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pagedllm.model_registry.tiny.corpus import load_split

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [source.text for source in load_split("train")]
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map,
        "added_tokens_decoder": added_tokens_decoder,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": chat_template(),
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)


def source_encoder(tokenizer_dir: Path) -> Tokenizer:
    """The saved tokenizer, set to encode special-token strings as plain text
    (for corpus files; not for rendered chat prompts)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    return tokenizer


def token_stream(split: str, tokenizer_dir: Path, *, for_metric: bool = False) -> list[int]:
    """The split's files as one token list, each file preceded by BOS.

    Special-token strings inside the sources stay text (`source_encoder`).
    """
    from pagedllm.model_registry.tiny.corpus import load_split

    tokenizer = source_encoder(tokenizer_dir)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    if bos_id is None:
        raise ValueError(f"{tokenizer_dir} has no {BOS_TOKEN} token")
    texts = [source.text for source in load_split(split, for_metric=for_metric)]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(bos_id)
        ids.extend(encoding.ids)
    return ids


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Special token -> id, read from a saved tokenizer.json."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return {entry["content"]: entry["id"] for entry in data["added_tokens"]}


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
