"""The front end's tokenizer: loading it and checking token-id prompts.

Shared by the offline LLM and AsyncLLM (the server's front end)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import InvalidRequestError


def load_tokenizer(path: str) -> Any:
    """`path` is a folder, a hub id or a name a model source knows (`tiny`)."""
    from transformers import AutoTokenizer

    from pagedllm.engine.model_source import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def check_token_ids(token_ids: Any) -> list[int]:
    """A prompt given as token ids: a list of ints (range checks need the vocab
    size and happen with the other prompt checks in engine.validate_prompt)."""
    if not isinstance(token_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise InvalidRequestError("prompt_token_ids", token_ids, "must be a list of integers")
    return list(token_ids)


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
