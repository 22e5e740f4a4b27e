"""A linear layer whose output rows stack several checkpoint matrices.

q/k/v_proj load into one qkv_proj and gate/up_proj into one gate_up_proj, so
each is one matmul at run time. ``weight_loader`` copies one checkpoint shard
into its row range.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        for param in self.parameters():
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        from pagedllm.model_registry.loader import check_weight_shape

        shard = param.data.narrow(0, self.shard_offsets[shard_id], self.output_sizes[shard_id])
        check_weight_shape(shard, loaded)
        shard.copy_(loaded)
