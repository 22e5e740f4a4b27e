"""RMSNorm over a vector that tensor parallelism splits across ranks.

OLMo 2 normalizes the whole q projection (all heads, num_heads * head_dim
wide) and the whole k projection, not each head. Under tensor parallelism a
rank holds only its heads' columns, so the mean square needs every rank's
share: each rank sums its squares, one all-reduce of that [T, 1] sum gives
the total, and each rank scales its own columns by its slice of the weight.
That moves one float per token and tensor where vLLM all-gathers the whole
projection. Several norms share one all-reduce (`sharded_rms_norms`).

A rank's width is `shard_size`; the mean is over shard_size * tp_size. When
KV heads are replicated (fewer KV heads than ranks) each copy adds its
squares once per rank that holds it, and each copy is counted in that width
too, so the mean is the full projection's all the same.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.linear import copy_shard


class ShardedRMSNorm(nn.Module):
    """This rank's `shard_size` columns of an RMSNorm `full_size` wide; the
    rank holds the columns [shard_index * shard_size, (shard_index + 1) * shard_size)."""

    def __init__(self, full_size: int, shard_size: int, shard_index: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.full_size, self.shard_index, self.eps = full_size, shard_index, eps
        self.weight = nn.Parameter(torch.ones(shard_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        copy_shard(param, loaded_weight, 0, self.shard_index * size, self.full_size)

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:  # [T, shard] -> [T, 1] float32
        return x.float().pow(2).sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, total_sum_of_squares: torch.Tensor, width: int) -> torch.Tensor:
        """x scaled by rsqrt(total / width + eps) and this rank's weight,
        in float32, cast back last (transformers' order)."""
        variance = total_sum_of_squares / width
        return (self.weight * (x.float() * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sharded_rms_norms([self], [x])[0]


def sharded_rms_norms(norms: list[ShardedRMSNorm], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """norms[i](xs[i]) for each i, with one all-reduce for all of them."""
    tp_group = get_tp_group()
    sums = torch.cat([norm.sum_of_squares(x) for norm, x in zip(norms, xs, strict=True)], dim=-1)  # [T, n]
    sums = tp_group.all_reduce(sums)
    return [
        norm.normalize(x, sums[:, i : i + 1], x.shape[-1] * tp_group.world_size)
        for i, (norm, x) in enumerate(zip(norms, xs, strict=True))
    ]
