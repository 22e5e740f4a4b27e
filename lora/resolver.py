"""LoRA resolvers (kind ``lora_resolver``, vLLM's ``LoRAResolver``): find an
adapter's folder by name when a request first names it.

The server asks the resolvers that `lora.lora_resolvers` enables, in order,
when a request's `model` is neither the base model nor a loaded adapter,
LoRA is enabled and runtime updating is allowed; the first folder returned
is loaded and validated like `POST /v1/load_lora_adapter` (a bad one is a
400), then the request is served with it and later requests find it loaded.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.config import LoRAConfig

# vLLM's variable for the filesystem resolver's folder.
RESOLVER_CACHE_DIR_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"


class LoRAResolver(abc.ABC):
    """Finds adapters by name. Built once per server as ``Cls(lora_config)``."""

    def __init__(self, config: LoRAConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def resolve_lora(
        self, base_model_name: str, lora_name: str
    ) -> str | Path | Awaitable[str | Path | None] | None:
        """The local folder of adapter `lora_name` for base model
        `base_model_name` (adapter_config.json + safetensors), or None when
        this resolver does not know it. May be a coroutine (a download):
        the server awaits it on its event loop, so a blocking resolver must
        hand its work to a thread itself.

        NOTE: `lora_name` is a client's string: never join it into a path
        without checking it stays inside the resolver's folder."""


class FilesystemResolver(LoRAResolver):
    """``<lora.lora_resolver_cache_dir>/<lora_name>/adapter_config.json``
    (vLLM's filesystem resolver; ``VLLM_LORA_RESOLVER_CACHE_DIR`` when the
    field is unset)."""

    def resolve_lora(self, base_model_name: str, lora_name: str) -> str | None:
        cache_dir = self.config.lora_resolver_cache_dir or os.environ.get(RESOLVER_CACHE_DIR_ENV)
        if not cache_dir or not lora_name or lora_name in (".", "..") or "/" in lora_name or "\\" in lora_name:
            return None
        root = Path(cache_dir).resolve()
        folder = (root / lora_name).resolve()
        # NOTE: a symlinked entry may not lead out of the cache folder.
        if folder.parent != root or not (folder / "adapter_config.json").is_file():
            return None
        return str(folder)


__all__ = ["RESOLVER_CACHE_DIR_ENV", "FilesystemResolver", "LoRAResolver"]
