"""The embedded model family, shipped inside the package, and its tokenizer.

- `pagedllm-tiny` (alias `tiny`): a trained ~6.5M-parameter Llama, the default
  model of `LLM()` and `pagedllm serve`.
- `pagedllm-tiny-draft` (alias `tiny-draft`): a ~1.4M-parameter Llama with the
  same tokenizer, for speculative-decoding experiments.
- `pagedllm-tiny-eagle` (alias `tiny-eagle`): an EAGLE-1 head for
  `pagedllm-tiny` (`speculative: {method: eagle, model: tiny-eagle}`),
  trained by `training/train_eagle.py`.

Both were trained by `training/tiny/train.py` (a checkout's, not installed) on the Python
standard library sources (see each folder's README.md) and live under
`weights/` as package data: nothing is trained or downloaded at run time.

The engine finds them through the built-in model source `tiny`
(`ShippedModelSource`, plugins/builtin.py), never by importing this package.

`get_benchmark_model_dir()` builds, once, into `$PAGEDLLM_CACHE_DIR` (default
`~/.cache/pagedllm`) the random-weight Llama the throughput benchmark uses;
its cache folder name carries a version: bump it whenever what it contains
changes.
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.model_registry.source import ModelSource
from pagedllm.model_registry.tiny.cache import build_once, get_cache_root

TARGET_MODEL_NAME = "pagedllm-tiny"
DRAFT_MODEL_NAME = "pagedllm-tiny-draft"
EAGLE_MODEL_NAME = "pagedllm-tiny-eagle"
# Every name a model path may be given as -> the shipped folder's name.
MODEL_ALIASES = {
    "tiny": TARGET_MODEL_NAME,
    TARGET_MODEL_NAME: TARGET_MODEL_NAME,
    "tiny-draft": DRAFT_MODEL_NAME,
    DRAFT_MODEL_NAME: DRAFT_MODEL_NAME,
    "tiny-eagle": EAGLE_MODEL_NAME,
    EAGLE_MODEL_NAME: EAGLE_MODEL_NAME,
}
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BENCHMARK_MODEL_CACHE_NAME = "benchmark-llama-v2"
BENCHMARK_100M_CACHE_NAME = "benchmark-llama-100m-v1"

__all__ = [
    "BENCHMARK_MODEL_CACHE_NAME",
    "DRAFT_MODEL_NAME",
    "EAGLE_MODEL_NAME",
    "MODEL_ALIASES",
    "TARGET_MODEL_NAME",
    "ShippedModelSource",
    "get_benchmark_100m_model_dir",
    "get_benchmark_model_dir",
    "get_cache_root",
    "get_default_model_dir",
    "get_tiny_model_dir",
    "get_tokenizer_dir",
    "resolve_model_path",
]


def get_tiny_model_dir(name: str = TARGET_MODEL_NAME) -> Path:
    """The shipped folder of `name` (a model name or one of its aliases)."""
    if name not in MODEL_ALIASES:
        raise ValueError(f"model={name!r} is not a shipped tiny model; expected one of {sorted(MODEL_ALIASES)}")
    return WEIGHTS_DIR / MODEL_ALIASES[name]


def get_default_model_dir() -> Path:
    """Folder of the default model, `pagedllm-tiny` (HF layout, float16 safetensors)."""
    return get_tiny_model_dir(TARGET_MODEL_NAME)


def get_tokenizer_dir() -> Path:
    """Folder with only tokenizer.json, tokenizer_config.json (chat template
    included) and special_tokens_map.json: the tokenizer of both shipped
    models, loadable by `AutoTokenizer`."""
    return WEIGHTS_DIR / "tokenizer"


def get_benchmark_model_dir() -> Path:
    """Folder of the throughput benchmark's model: a random-weight Llama
    (hidden 256, 4 layers) with the shipped tokenizer, float32 safetensors."""
    from pagedllm.model_registry.tiny.benchmark_model import build_benchmark_model

    tokenizer_dir = get_tokenizer_dir()
    return build_once(BENCHMARK_MODEL_CACHE_NAME, lambda out_dir: build_benchmark_model(out_dir, tokenizer_dir))


def get_benchmark_100m_model_dir() -> Path:
    """Folder of the ~100M random-weight Llama (LLAMA_100M) the scale-out
    benchmark runs, built on first use (about 350 MB of float32)."""
    from pagedllm.model_registry.tiny.benchmark_model import LLAMA_100M, build_benchmark_model

    tokenizer_dir = get_tokenizer_dir()
    return build_once(
        BENCHMARK_100M_CACHE_NAME, lambda out_dir: build_benchmark_model(out_dir, tokenizer_dir, LLAMA_100M)
    )


def resolve_model_path(name_or_path: str | os.PathLike[str] | None) -> str:
    """None -> the default model's folder; an alias (`tiny`, `tiny-draft`,
    `tiny-eagle`, or the full names) -> that shipped folder; anything else unchanged (a
    local folder or a hub id for the loader to handle).

    NOTE: an alias wins over a same-named folder in the working directory,
    so `tiny` means the same model wherever the command runs.
    """
    if name_or_path is None:
        return str(get_default_model_dir())
    if isinstance(name_or_path, str) and name_or_path in MODEL_ALIASES:
        return str(get_tiny_model_dir(name_or_path))
    return os.fspath(name_or_path)


class ShippedModelSource(ModelSource):
    """The model source `tiny`: every alias in MODEL_ALIASES is its shipped folder."""

    def resolve(self, name: str) -> str | None:
        return str(get_tiny_model_dir(name)) if name in MODEL_ALIASES else None
