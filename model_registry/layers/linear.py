"""Tensor-parallel linear layers (Megatron-LM, Shoeybi et al., 2019; vLLM's names).

Each layer holds only this rank's slice of the full matrix and reads its
tensor-parallel group (size and rank) once, at construction. Its
``weight_loader(param, loaded_weight[, shard_id])`` is given the FULL
checkpoint tensor (memory-mapped by the loader) and narrows it to this
rank's rows or columns before copying, so a rank never copies the whole
matrix.

- ColumnParallelLinear: output features split; each rank computes its slice
  of the output (all-gathered only when ``gather_output``).
- RowParallelLinear: input features split; the partial products are summed by
  one all-reduce, the bias added once after it.
- ReplicatedLinear: the whole matrix on every rank (a small layer not worth
  splitting, such as an EAGLE head's input projection).
- MergedColumnParallelLinear (gate/up) and QKVParallelLinear (q/k/v) stack
  several checkpoint matrices so each is one matmul; every stacked matrix is
  split per rank on its own.

At world size 1 every layer is the plain ``nn.Linear`` it replaces, same
shapes, same GEMM call. The layers stay ``nn.Linear`` subclasses, and the GEMM
goes through ``apply_linear(x, bias)``: the "linear" op of the op registry
(ops.py), so a platform or a quantization method supplies just the GEMM (the
CPU platform's oneDNN prepacking, int8) and the collectives stay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.lora import LoRASlots
from pagedllm.model_registry.layers.ops import LINEAR, OpLayer
from pagedllm.model_registry.layers.tp_heads import divide, partition_heads


def copy_shard(
    shard: torch.Tensor, loaded_weight: torch.Tensor, dim: int = 0, start: int = 0, full_size: int | None = None
) -> None:
    """Copy loaded_weight[start : start + shard.shape[dim]] (along `dim`) into
    `shard`, after checking the checkpoint tensor has the full shape: the
    shard's, with `full_size` along `dim` (None: the shard is the whole)."""
    expected = list(shard.shape)
    if full_size is not None:
        expected[dim] = full_size
    if list(loaded_weight.shape) != expected:
        raise ValueError(
            f"shape mismatch: model expects {tuple(expected)}, checkpoint has {tuple(loaded_weight.shape)}"
        )
    if full_size is not None:
        loaded_weight = loaded_weight.narrow(dim, start, shard.shape[dim])
    with torch.no_grad():
        shard.copy_(loaded_weight)  # converts dtype and device


class LinearBase(nn.Linear, OpLayer, ABC):
    """An ``nn.Linear`` of this rank's shape that knows its tensor-parallel
    group; each subclass says which slice of a checkpoint tensor is its own."""

    op_name = LINEAR
    # True on a layer that quantization leaves in its float dtype (the worker
    # never hands it to a quantization method): one whose weight other code
    # reads as a float matrix rather than through `apply_linear` (DeepSeek's
    # kv_b_proj, absorbed into the latent attention), and a mixture-of-experts
    # router (moe_router.RouterLinear: its few logits per token choose the
    # experts; vLLM keeps routers unquantized too).
    skip_quantization = False

    def __init__(self, input_size_per_partition: int, output_size_per_partition: int, bias: bool) -> None:
        super().__init__(input_size_per_partition, output_size_per_partition, bias=bias)
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank_in_group
        self.tp_size = self.tp_group.world_size
        for param in self.parameters():
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # A LoRA-enabled model's adapter slots (lora/ attaches them before
        # the ops are bound); None: this layer is never adapted.
        self.lora_slots: LoRASlots | None = None

    def apply_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's GEMM: the bound "linear" kernel, else F.linear; plus
        each row's adapter product when the layer has LoRA slots."""
        kernel = self.op_kernel
        output = F.linear(x, self.weight, bias) if kernel is None else kernel(x, bias)
        lora_slots = self.lora_slots
        if lora_slots is not None:
            lora_slots.add_lora(output, x)
        return output

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's slice of the full checkpoint tensor into `param`."""


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank; its GEMM is the "linear" op all the same."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        copy_shard(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, O]
        return self.apply_linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (output features): rank r holds
    A[:, r * O/tp : (r + 1) * O/tp] (``weight`` rows, in nn.Linear's layout)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(input_size, divide(output_size, tp_size, "output features"), bias)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        size = param.shape[0]
        copy_shard(param, loaded_weight, 0, self.tp_rank * size, size * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, O/tp], or [T, O] when gathered
        output = self.apply_linear(x, self.bias)
        if self.gather_output and self.tp_size > 1:
            output = self.tp_group.all_gather(output, dim=-1)
        return output


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked on the output (gate and up):
    rank r holds its slice of each, in order, [gate_r | up_r]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        # Per rank: where shard i starts in this rank's rows, and how many it has.
        self.shard_sizes = [divide(size, self.tp_size, "output features") for size in output_sizes]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(output_sizes))]

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int
    ) -> None:
        size = self.shard_sizes[shard_id]
        shard = param.data.narrow(0, self.shard_offsets[shard_id], size)
        copy_shard(shard, loaded_weight, 0, self.tp_rank * size, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v stacked on the output, split by heads: each rank holds
    num_heads / tp query heads and the KV heads they read. With fewer KV heads
    than ranks each KV head is REPLICATED on tp / num_kv_heads ranks (rank r
    holds KV head r // replicas, the one its query heads use under GQA)."""

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = partition_heads(
            total_num_heads, total_num_kv_heads, tp_size
        )
        self.q_size = self.num_heads * head_size  # per rank
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias=bias)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int
    ) -> None:
        if shard_id == 0:  # q
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
            full_size = self.q_size * self.tp_size
        else:  # k (1) or v (2): the KV head(s) of this rank's query heads
            offset = self.q_size + (shard_id - 1) * self.kv_size
            size, start = self.kv_size, (self.tp_rank // self.num_kv_head_replicas) * self.kv_size
            full_size = self.kv_size * self.tp_size // self.num_kv_head_replicas
        copy_shard(param.data.narrow(0, offset, size), loaded_weight, 0, start, full_size)


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (input features): each rank multiplies its
    slice of X (the column-parallel layer before it left X split) by
    A[r * I/tp : (r + 1) * I/tp, :]; one all-reduce sums the partial products.
    `reduce_results=False`: the partial product is returned (rank 0's with
    the bias) for the caller to add to others before one all-reduce (a MoE
    block's shared expert and routed experts)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        tp_size = get_tp_group().world_size
        super().__init__(divide(input_size, tp_size, "input features"), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            copy_shard(param, loaded_weight)
            return
        size = param.shape[1]
        copy_shard(param, loaded_weight, 1, self.tp_rank * size, size * self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, I/tp] -> [T, O]
        if self.tp_size == 1:
            return self.apply_linear(x, self.bias)
        if not self.reduce_results:
            return self.apply_linear(x, self.bias if self.tp_rank == 0 else None)
        # NOTE: the bias goes in once, after the sum, not once per rank.
        output = self.tp_group.all_reduce(self.apply_linear(x, None))
        return output if self.bias is None else output + self.bias
