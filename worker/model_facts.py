"""ModelFacts: what a model's config says, read before anything is built from
it (worker/worker.py reads them; the builder, READY and executors report
them). Imports only the head split (model_registry/layers/tp_heads.py) and
the RoPE parameters (layers/rope_parameters.py), no torch, so interfaces may
name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.model_registry.layers.rope_parameters import rope_position_limit
from pagedllm.model_registry.layers.tp_heads import HeadPartition, partition_heads

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagedllm.attention_backends.base import AttentionBackend, AttentionRequirements, KVCacheLayout
    from pagedllm.model_registry.model_impl import ModelImplChoice


@dataclass(frozen=True)
class ModelFacts:
    """What the model's config says, read before anything is built from it."""

    path: str  # the model folder (a model source's name resolved) or hub id
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype  # the compute dtype
    # What the KV cache stores (cache.cache_dtype resolved): `dtype`, or an fp8 dtype.
    kv_cache_dtype: torch.dtype
    head_size: int
    num_kv_heads: int  # the whole model's; a rank holds heads_per_rank(tp).num_kv_heads
    sliding_window: int | None
    # What the model's attention layers ask of the backend (the model
    # class's `attention_requirements`); None: only head_size and sliding_window.
    attention_requirements: AttentionRequirements | None = None
    # Which implementation serves the architecture (model.model_impl resolved), and why.
    model_impl: ModelImplChoice | None = None

    @property
    def position_limit(self) -> int | None:
        """max_position_embeddings (times the factor for dynamic NTK RoPE)."""
        return rope_position_limit(self.hf_config)

    @property
    def is_latent(self) -> bool:
        """Latent attention (MLA): the cache keeps one vector per token
        (`head_size` wide, one "KV head", the same on every rank)."""
        requirements = self.attention_requirements
        return requirements is not None and requirements.latent_kv_size is not None

    def kv_cache_layout(self, attn_backend: type[AttentionBackend]) -> KVCacheLayout:
        """How this model's KV tensors hold their blocks on `attn_backend`."""
        return attn_backend.get_mla_kv_cache_layout() if self.is_latent else attn_backend.get_kv_cache_layout()

    def heads_per_rank(self, tp_size: int) -> HeadPartition:
        """Each rank's query and KV heads at `tp_size`: exactly the split of
        the model's QKVParallelLinear (ConfigError when they cannot be split)."""
        return partition_heads(self.hf_config.num_attention_heads, self.num_kv_heads, tp_size)

    def impl(self) -> ModelImplChoice:
        """`model_impl`, which `read_model_facts` always sets."""
        if self.model_impl is None:
            raise RuntimeError("ModelFacts.model_impl was not resolved (build facts with read_model_facts)")
        return self.model_impl
