"""Where one checkpoint module's LoRA A and B land in a layer's slots.

A PEFT adapter names the modules of the base checkpoint
(`model.layers.0.self_attn.q_proj`) and gives each an A [r, in] and a B
[out, r] (its scaling already folded into B). The model may hold that
module as one sub-matrix of a stacked layer (q of qkv_proj: sub-block 0 of
the layer's slots), as the whole of a layer whose checkpoint tensor is
itself fused (Phi-3's qkv_proj: one module, its rows split into q, k and v
as the weight's are), or as a plain layer.

Under tensor parallelism B's rows are this rank's exactly as the weight's
rows are (column-parallel, stacked and QKV layers, KV heads replicated
where the weight's are), and A's columns are as the weight's columns are
(row-parallel layers): both go through the layer's own `weight_loader`,
which already knows this rank's slice of every checkpoint tensor, into
scratch tensors shaped like this rank's weight with r columns (or rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.model_registry.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model_registry.layers.lora import LoRASlots


@dataclass(frozen=True)
class LoRATarget:
    """One checkpoint module of the base model, as an adapter may adapt it."""

    layer: LinearBase
    slots: LoRASlots
    # Its rank-`max_rank` block in the layer's slots (its sub-matrix).
    sub: int
    # The stacked layer's shard id of this module (q_proj: 0 of qkv_proj); None: not stacked.
    shard_id: int | None
    # A fused checkpoint module's rows per shard id (Phi-3's qkv_proj: q, k, v); None: not fused.
    fused_sizes: tuple[int, ...] | None
    # The checkpoint's (out, in), unsharded.
    full_shape: tuple[int, int]

    def load(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Copy this rank's shard of A [r, in] and B [out, r] into `slot`'s
        block of the layer (a rank below max_rank fills its first r rows of
        A and columns of B; the rest stays zero: the slot was cleared)."""
        rank = lora_a.shape[0]
        start = self.sub * self.slots.max_rank
        a_block = self.slots.lora_a[slot, start : start + rank]  # [r, in (this rank's)]
        b_block = self.slots.lora_b[slot, :, start : start + rank]  # [out (this rank's), r]
        layer = self.layer
        with torch.no_grad():
            if isinstance(layer, RowParallelLinear):
                layer.weight_loader(a_block, lora_a)  # type: ignore[arg-type]  # this rank's columns
            else:
                a_block.copy_(lora_a)
            if isinstance(layer, ColumnParallelLinear):
                b_block.copy_(self._column_shard(lora_b))
            else:
                b_block.copy_(lora_b)

    def _column_shard(self, lora_b: torch.Tensor) -> torch.Tensor:
        """B's rows as this rank's weight rows: [this rank's out rows, r],
        zero outside this module's own rows of a stacked layer."""
        layer = self.layer
        shard = torch.zeros(layer.out_features, lora_b.shape[1], dtype=self.slots.lora_b.dtype,
                            device=self.slots.lora_b.device)
        if self.fused_sizes is not None:
            for shard_id, part in enumerate(lora_b.split(list(self.fused_sizes), dim=0)):
                layer.weight_loader(shard, part, shard_id)  # type: ignore[arg-type, call-arg]
        elif self.shard_id is not None:
            layer.weight_loader(shard, lora_b, self.shard_id)  # type: ignore[arg-type, call-arg]
        else:
            layer.weight_loader(shard, lora_b)  # type: ignore[arg-type]
        return shard


def stacked_output_sizes(layer: LinearBase) -> list[int]:
    """This rank's rows of each checkpoint matrix a stacked layer holds, in shard order."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.shard_sizes)
    return [layer.out_features]


def full_rows(layer: LinearBase, shard_id: int | None) -> int:
    """The checkpoint's rows of shard `shard_id` of `layer` (None: the whole layer's)."""
    if isinstance(layer, QKVParallelLinear):
        q_rows = layer.q_size * layer.tp_size
        kv_rows = layer.kv_size * layer.tp_size // layer.num_kv_head_replicas
        sizes = [q_rows, kv_rows, kv_rows]
        return sum(sizes) if shard_id is None else sizes[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        return sum(layer.output_sizes) if shard_id is None else layer.output_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        return layer.out_features * layer.tp_size
    return layer.out_features


def full_columns(layer: LinearBase) -> int:
    return layer.in_features * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)
