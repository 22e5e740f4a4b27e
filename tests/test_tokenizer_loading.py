"""`load_tokenizer` skips AutoTokenizer for folders that declare transformers'
generic fast tokenizer (a server's start does not import torch for it), and
loads exactly what AutoTokenizer loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import cached_tiny_model
from transformers import AutoTokenizer

from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.model_registry.tiny import get_tokenizer_dir
from pagedllm.model_registry.tokenizer import declares_generic_tokenizer, load_tokenizer

TEXTS = ["Hello there, how are you?", "  spaces\tand\nlines  ", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 漢字 🙂"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def behaviour(tokenizer: Any) -> dict[str, Any]:
    """What the front end uses of a tokenizer, as plain values."""
    encoded = [tokenizer.encode(text, add_special_tokens=special) for text in TEXTS for special in (True, False)]
    return {
        "class": type(tokenizer),
        "len": len(tokenizer),
        "special": (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.all_special_ids),
        "encoded": encoded,
        "decoded": [tokenizer.decode(ids) for ids in encoded],
        "skip_special": [tokenizer.decode(ids, skip_special_tokens=True) for ids in encoded],
        "tokens": [tokenizer.convert_ids_to_tokens(ids) for ids in encoded],
        "chat": tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        if tokenizer.chat_template else None,
        "backend": tokenizer.backend_tokenizer.to_str(),
    }


def generic_folders() -> dict[str, str]:
    return {
        "shipped model": resolve_model_path("tiny"),
        "tokenizer only": str(get_tokenizer_dir()),
        "test llama": str(cached_tiny_model("llama", with_tokenizer=True)),
    }


@pytest.mark.parametrize("name", ["shipped model", "tokenizer only", "test llama"])
def test_a_generic_tokenizer_loads_as_autotokenizer_loads_it(name: str) -> None:
    folder = generic_folders()[name]
    assert declares_generic_tokenizer(folder)
    assert behaviour(load_tokenizer(folder)) == behaviour(AutoTokenizer.from_pretrained(folder))


def test_a_model_type_transformers_overrides_goes_through_autotokenizer() -> None:
    # transformers gives qwen2 its own class whatever tokenizer_config.json declares.
    folder = str(cached_tiny_model("qwen2", with_tokenizer=True))
    assert not declares_generic_tokenizer(folder)
    assert behaviour(load_tokenizer(folder)) == behaviour(AutoTokenizer.from_pretrained(folder))


def test_custom_code_or_another_class_is_not_taken_for_generic(tmp_path: Path) -> None:
    source = Path(resolve_model_path("tiny"))
    for edit in ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, {"tokenizer_class": "LlamaTokenizer"}):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(source, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **edit}))
        assert not declares_generic_tokenizer(str(folder)), edit
