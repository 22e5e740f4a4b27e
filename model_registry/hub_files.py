"""Which files of a hub repo a load needs: the configs, the tokenizer and
one weight format, never a repo's other copies (`original/` folders,
consolidated .pth checkpoints, .bin files beside safetensors).

`files_to_download` picks from the repo's file list at the pinned commit;
`weight_files` is the one place a new weight format (GGUF) adds its rule.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.*",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
SAFETENSORS_FILES = ("*.safetensors", "model.safetensors.index.json")
PT_FILES = ("*.bin", "pytorch_model.bin.index.json")
# A second copy of the weights in another layout (Mistral's consolidated.*,
# Meta's consolidated.00.pth): the loader never reads it.
NEVER_FILES = ("consolidated*",)


def files_to_download(repo_files: Iterable[str], load_format: str, *, tokenizer_only: bool = False) -> list[str]:
    """The top-level files of `repo_files` a load reads, sorted: configs and
    tokenizer files, plus the weights of `load_format` unless
    `tokenizer_only`. Subfolders (`original/`, ...) are never loaded."""
    top_level = sorted(name for name in repo_files if "/" not in name and not _matches(name, NEVER_FILES))
    wanted = [name for name in top_level if _matches(name, CONFIG_FILES + TOKENIZER_FILES)]
    if not tokenizer_only:
        wanted += weight_files(top_level, load_format)
    return sorted(set(wanted))


def weight_files(top_level: list[str], load_format: str) -> list[str]:
    """The weight files of one format (`model.load_format`): auto =
    safetensors when the repo has any, else PyTorch .bin; dummy = none."""
    safetensors = [name for name in top_level if _matches(name, SAFETENSORS_FILES)]
    if load_format == "safetensors" or (load_format == "auto" and any(n.endswith(".safetensors") for n in top_level)):
        return safetensors
    if load_format in ("auto", "pt"):
        return [name for name in top_level if _matches(name, PT_FILES)]
    return []


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
