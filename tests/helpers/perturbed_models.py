"""Tiny checkpoints like tiny_models', with every weight perturbed.

transformers initializes norm weights to exactly 1, so a norm weight loaded
into the wrong columns (a rank's slice of OLMo 2's q/k norm) would pass any
comparison. These checkpoints go through the conformance kit's
`save_random_checkpoint` (each parameter + N(0, 0.02), the shipped
tokenizer copied in), so every weight is distinct.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from helpers.tiny_models import TINY_DEFAULTS, _config_class

_cache: dict[tuple[Any, ...], Path] = {}
_cache_root: list[Path] = []


def cached_perturbed_model(arch: str, *, seed: int = 0, **config_overrides: Any) -> Path:
    """A float32 checkpoint of `arch` (tiny_models' sizes and config class),
    built once per process for the same arguments. NOTE: do not modify it."""
    key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in config_overrides.items())))
    if key not in _cache:
        from pagedllm.testing.checkpoints import save_random_checkpoint

        if not _cache_root:
            _cache_root.append(Path(tempfile.mkdtemp(prefix="pagedllm-perturbed-models-")))
            atexit.register(shutil.rmtree, _cache_root[0], True)
        config_cls = _config_class(arch)
        config = config_cls(**{**TINY_DEFAULTS, **config_overrides}).to_dict()
        config["architectures"] = [config_cls.__name__.replace("Config", "ForCausalLM")]
        _cache[key] = save_random_checkpoint(config, _cache_root[0] / f"{arch}-{len(_cache)}", seed=seed)
    return _cache[key]
