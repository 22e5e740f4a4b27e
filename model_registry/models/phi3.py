"""Phi-3 (Abdin et al., 2024); also Phi-3.5 and Phi-4 text models.

Llama's graph (pre-norm, SwiGLU, grouped-query attention); what differs is
in the checkpoint and the rotary table:

- q, k and v are one `qkv_proj` tensor [(H + 2 * Hkv) * D, hidden], gate and
  up one `gate_up_proj` [2 * I, hidden]. Loading splits each into its parts
  and hands every part to the stacked layer's weight loader, which narrows it
  to this rank's heads (or rows) under tensor parallelism, exactly as the
  separate q/k/v and gate/up tensors of a Llama checkpoint are loaded.
- LongRoPE (`longrope`, legacy `su`) with short and long factors and an
  attention factor, and partial rotary (Phi-4-mini: 0.75 of each head); both
  live in layers/rotary.py, whose docstring says which factors a position
  gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint names our stacked modules already: nothing to rename.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype = torch.float32):
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError("hidden_act", hidden_act, "silu (the activation Phi3ForCausalLM implements)")
        super().__init__(hf_config, attn_backend, dtype)

    def fused_split_sizes(self) -> dict[str, list[int]]:
        """Rows of each fused checkpoint tensor that belong to each stacked shard."""
        config = self.config
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return {
            "qkv_proj": [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            "gate_up_proj": [config.intermediate_size, config.intermediate_size],
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        split_sizes = self.fused_split_sizes()
        params = dict(self.named_parameters())
        fused_loaded: set[str] = set()

        def unfused() -> Iterator[tuple[str, torch.Tensor]]:
            """Loads the fused tensors on the way; yields the rest to Llama's loader."""
            for name, tensor in weights:
                parts = name.split(".")
                sizes = split_sizes.get(parts[-2]) if len(parts) > 1 else None
                if sizes is None or name not in params:
                    yield name, tensor
                    continue
                if tensor.shape[0] != sum(sizes):
                    raise ValueError(f"{name}: expected {sum(sizes)} rows ({' + '.join(map(str, sizes))}), "
                                     f"checkpoint has {tuple(tensor.shape)}")
                param = params[name]
                for shard_id, part in enumerate(tensor.split(sizes, dim=0)):
                    param.weight_loader(param, part, shard_id)  # type: ignore[attr-defined]
                fused_loaded.add(name)

        return super().load_weights(unfused()) | fused_loaded
