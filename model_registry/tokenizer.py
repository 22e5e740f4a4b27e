"""A model's tokenizer: loading it, and the EOS id its config names.

The front ends (the offline LLM, AsyncLLM), the engine core and the grammar
backends load it through `load_tokenizer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_config.json's names for transformers' generic fast tokenizer (a
# tokenizer.json and nothing model-specific).
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# config.json model types for which AutoTokenizer loads a generic class as
# declared (no model-specific override; "" = a folder without config.json).
# tests/test_tokenizer_loading.py compares the two on each.
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", ""})


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """`path` is a folder, a hub id, a name a model source knows (`tiny`) or
    a `.gguf` file (a llama.cpp checkpoint whose metadata holds the tokenizer).
    A tokenizer class the checkpoint ships (tokenizer_config.json's auto_map)
    is imported only with `trust_remote_code`.

    A local folder that declares transformers' generic fast tokenizer loads
    it directly: AutoTokenizer would come to the same class, but first imports
    transformers' config machinery and torch (~2 s of a server's start, in a
    process that needs neither)."""
    from pagedllm.model_registry.model_source import resolve_model_path

    resolved = resolve_model_path(path)
    if resolved.endswith(".gguf"):  # built from the file's metadata (tokens, merges, special ids)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(Path(resolved).parent), gguf_file=Path(resolved).name, local_files_only=True, trust_remote_code=False
        )
    if declares_generic_tokenizer(resolved):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(resolved)
    from transformers import AutoTokenizer

    from pagedllm.model_registry.remote_code import remote_code_guard

    with remote_code_guard(resolved, "tokenizer", trust_remote_code):
        return AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)


def declares_generic_tokenizer(folder: str) -> bool:
    """True for a local folder whose tokenizer is transformers' generic fast
    one, by its tokenizer_config.json (no custom code) and config.json."""
    tokenizer_config = _read_json(Path(folder) / "tokenizer_config.json")
    if tokenizer_config is None or "auto_map" in tokenizer_config or not (Path(folder) / "tokenizer.json").is_file():
        return False
    if tokenizer_config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return False
    model_config = _read_json(Path(folder) / "config.json") if (Path(folder) / "config.json").exists() else {}
    return model_config is not None and model_config.get("model_type", "") in GENERIC_TOKENIZER_MODEL_TYPES


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def config_eos_token_id(hf_config: Any) -> int | None:
    """config.json's EOS id (the first, when it lists several)."""
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def eos_token_id(hf_config: Any, tokenizer: Any) -> int | None:
    """The model's EOS id, else the tokenizer's."""
    eos = config_eos_token_id(hf_config)
    return eos if eos is not None else tokenizer.eos_token_id
