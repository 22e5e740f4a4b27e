"""Tiny random-weight HF checkpoints that tests build themselves (no hub)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedllm.testing.checkpoints import TINY_SIZES

# The conformance kit's tiny sizes with a vocabulary of our own; head_dim
# only where a config defaults it to something else (build_tiny_model).
TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512, **{key: value for key, value in TINY_SIZES.items() if key != "head_dim"}
}

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "granite", "olmo2")
# Their configs default head_dim to 128 or 256.
OWN_HEAD_DIM = ("qwen3", "mistral", "gemma2", "gemma3")


def _config_class(arch: str) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig,
               "granite": GraniteConfig, "olmo2": Olmo2Config}
    if arch not in classes:
        raise ValueError(f"arch={arch!r}; expected one of {ARCHITECTURES}")
    return classes[arch]


def build_tiny_model(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    with_tokenizer: bool = False,
    norm_noise: float = 0.0,
    **config_overrides: Any,
) -> Path:
    """Save a float32 random-weight HF model (safetensors) under ``path``.

    With ``with_tokenizer`` the tokenizer files of the embedded default model
    are copied in and the vocabulary (and bos/eos ids) follow that tokenizer
    unless overridden. ``norm_noise`` adds N(0, norm_noise) to every norm
    weight (transformers initialises them to a constant: Gemma's (1 + w) to
    w = 0, which a model ignoring w would pass).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_kwargs = dict(TINY_DEFAULTS)
    if arch in OWN_HEAD_DIM:
        config_kwargs["head_dim"] = TINY_DEFAULTS["hidden_size"] // TINY_DEFAULTS["num_attention_heads"]
    if with_tokenizer:
        from transformers import AutoTokenizer

        from pagedllm.model_registry.tiny import get_tokenizer_dir

        tokenizer_dir = Path(get_tokenizer_dir())
        for item in tokenizer_dir.iterdir():
            if item.is_file():
                shutil.copy(item, path / item.name)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        config_kwargs["vocab_size"] = len(tokenizer)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, key, None) is not None:
                config_kwargs[key] = getattr(tokenizer, key)
    config_kwargs.update(config_overrides)
    config = _config_class(arch)(**config_kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if norm_noise:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * norm_noise)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


_cache: dict[tuple[Any, ...], Path] = {}
_cache_root: Path | None = None


def _remove_cache_root() -> None:
    if _cache_root is not None:
        shutil.rmtree(_cache_root, ignore_errors=True)


def cached_tiny_model(
    arch: str, *, seed: int = 0, with_tokenizer: bool = False, norm_noise: float = 0.0, **config_overrides: Any
) -> Path:
    """`build_tiny_model` once per process for the same arguments.

    NOTE: callers must not modify the folder; copy it first.
    """
    global _cache_root
    key = (arch, seed, with_tokenizer, norm_noise, tuple(sorted((k, repr(v)) for k, v in config_overrides.items())))
    if key not in _cache:
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="pagedllm-tiny-models-"))
            atexit.register(_remove_cache_root)
        _cache[key] = build_tiny_model(
            arch, _cache_root / f"{arch}-{len(_cache)}", seed=seed, with_tokenizer=with_tokenizer,
            norm_noise=norm_noise, **config_overrides,
        )
    return _cache[key]
