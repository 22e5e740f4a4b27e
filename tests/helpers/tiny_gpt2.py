"""A tiny random GPT-2 saved by transformers (for the example model plugin).

Built with transformers' own ``GPT2Config`` + ``GPT2LMHeadModel.save_pretrained``
(float32 safetensors, Conv1D weights, tied lm_head) next to the shared
tokenizer of the embedded default model, so prompts can be text.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

GPT2_DEFAULTS: dict[str, Any] = dict(n_positions=256, n_embd=64, n_layer=2, n_head=4)


def build_tiny_gpt2(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(get_tokenizer_dir())
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = GPT2Config(
        **{
            **GPT2_DEFAULTS,
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            **config_overrides,
        }
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).to(torch.float32).save_pretrained(str(path), safe_serialization=True)
    return path


_cache: dict[tuple[Any, ...], Path] = {}


def cached_tiny_gpt2(*, seed: int = 0, **config_overrides: Any) -> Path:
    """`build_tiny_gpt2` once per process for the same arguments. NOTE: do not modify the folder."""
    key = (seed, tuple(sorted((k, repr(v)) for k, v in config_overrides.items())))
    if key not in _cache:
        root = Path(tempfile.mkdtemp(prefix="pagedllm-tiny-gpt2-"))
        atexit.register(shutil.rmtree, root, True)
        _cache[key] = build_tiny_gpt2(root / "gpt2", seed=seed, **config_overrides)
    return _cache[key]


def transformers_greedy(path: str | Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by transformers' own GPT2LMHeadModel (full forward each step)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()
