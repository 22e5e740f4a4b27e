"""The embedded default model and its tokenizer, built once into a cache folder.

`get_tokenizer_dir()` trains the byte-level BPE tokenizer (a few seconds, once);
`get_default_model_dir()` adds a tiny random-weight Llama next to a copy of it.
Both live under `$PAGEDLLM_CACHE_DIR` (default `~/.cache/pagedllm`) in folders
whose names carry a version: bump it whenever what they contain changes.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.model_registry.tiny.cache import build_once, get_cache_root

# The trained family (issue 5) ships under WEIGHTS_DIR; until it does, the
# default stays the random-weight model below and these names only resolve paths.
TARGET_MODEL_NAME = "pagedllm-tiny"
DRAFT_MODEL_NAME = "pagedllm-tiny-draft"
MODEL_ALIASES = {
    "tiny": TARGET_MODEL_NAME,
    TARGET_MODEL_NAME: TARGET_MODEL_NAME,
    "tiny-draft": DRAFT_MODEL_NAME,
    DRAFT_MODEL_NAME: DRAFT_MODEL_NAME,
}
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

TOKENIZER_CACHE_NAME = "tokenizer-bpe8k-v1"
DEFAULT_MODEL_CACHE_NAME = "default-llama-v1"

__all__ = [
    "DEFAULT_MODEL_CACHE_NAME",
    "DRAFT_MODEL_NAME",
    "MODEL_ALIASES",
    "TARGET_MODEL_NAME",
    "WEIGHTS_DIR",
    "TOKENIZER_CACHE_NAME",
    "get_cache_root",
    "get_default_model_dir",
    "get_tokenizer_dir",
    "resolve_model_path",
]


def get_tokenizer_dir() -> Path:
    """Folder with tokenizer.json, tokenizer_config.json (chat template
    included) and special_tokens_map.json; loadable by `AutoTokenizer`."""
    from pagedllm.model_registry.tiny.tokenizer import train_tokenizer

    return build_once(TOKENIZER_CACHE_NAME, train_tokenizer)


def get_default_model_dir() -> Path:
    """Folder of the embedded default model (HF layout, float32 safetensors)."""
    from pagedllm.model_registry.tiny.default_model import build_default_model

    tokenizer_dir = get_tokenizer_dir()
    return build_once(DEFAULT_MODEL_CACHE_NAME, lambda out_dir: build_default_model(out_dir, tokenizer_dir))


def resolve_model_path(name_or_path: str | os.PathLike[str] | None) -> str:
    """None -> the embedded default model's folder; anything else unchanged
    (a local folder or a hub id for the loader to handle)."""
    if name_or_path is None:
        return str(get_default_model_dir())
    return os.fspath(name_or_path)
