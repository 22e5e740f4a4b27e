"""Build the shipped tokenizer and the token streams training reads.

`train_tokenizer` trains the byte-level BPE tokenizer of the shipped models
(`pagedllm/model_registry/tiny/tokenizer.py` holds its runtime side: the
special tokens, `source_encoder`, `special_token_ids`) on the train split of
the corpus; `token_stream` is a split's files as one token list.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.model_registry.tiny.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    chat_template,
    source_encoder,
)


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


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
