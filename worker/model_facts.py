"""ModelFacts: what a model's config says, read before anything is built from
it (worker/worker.py reads them; the builder, READY and executors report
them). Imports nothing of pagedllm, so interfaces may name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelFacts:
    """What the model's config says, read before anything is built from it."""

    path: str  # the model folder (a model source's name resolved) or hub id
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    head_size: int
    num_kv_heads: int
    sliding_window: int | None

    @property
    def position_limit(self) -> int | None:
        return getattr(self.hf_config, "max_position_embeddings", None)
