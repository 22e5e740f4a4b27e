"""LoRA slots of a linear layer (Hu et al., 2021; batched as in Punica and S-LoRA).

A LoRA-enabled model gives each adapted linear layer a `LoRASlots`: the
A and B matrices of every adapter slot, stacked,

    lora_a  [num_slots + 1, R, in]    R = num_sub * max_rank
    lora_b  [num_slots + 1, out, R]

and the layer adds, to each row t of its output,

    y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T,   s = token_slots[t]

Slot 0 is the base model and stays zero, so a row without an adapter gets
nothing (a kernel may skip it). A layer that stacks several checkpoint
matrices (q/k/v, gate/up: `output_sizes`, this rank's rows of each) gives
each its own rank-`max_rank` block: sub-matrix i's A is rows
i*max_rank..(i+1)*max_rank of lora_a, and its B fills only its own output
rows and those columns, so one shrink and one expand serve all of them. An
adapter of a smaller rank fills the first rows/columns of its block and
leaves zeros; its scaling (alpha / r) is folded into B when it is loaded.
Under tensor parallelism each rank holds its layer's shard: a column-
parallel layer this rank's rows of B, a row-parallel one its columns of A
(the partial products are summed by the layer's all-reduce, as its GEMM's).

The step's slot per row is `LoRABatchState.token_slots` (int32 [T]), one
object shared by every LoRA layer of a model: the model runner sets it
before each forward (None when no row of the step has an adapter, and the
layers add nothing). In a captured graph it is a persistent buffer the
graph re-reads at each replay.

The "lora" op (ops.py) computes the addition; `build(layer)` returns a
kernel `(y [T, out], x [T, in], token_slots int32 [T]) -> None` that adds
in place, reading the layer's `lora_a` / `lora_b`. `lora_reference` is the
plain-torch definition every kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_registry.layers.ops import LORA, OpLayer
from pagedllm.platforms.cpu.graph import capturing_any_graph


class LoRABatchState:
    """The step's adapter slot of each row, shared by a model's LoRA layers."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None  # int32 [T]; None: no adapter this step


class LoRASlots(nn.Module, OpLayer):
    op_name = LORA
    lora_a: torch.Tensor  # [num_slots + 1, num_sub * max_rank, in]
    lora_b: torch.Tensor  # [num_slots + 1, out, num_sub * max_rank]

    def __init__(
        self,
        state: LoRABatchState,
        *,
        num_slots: int,
        max_rank: int,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """`input_size` and `output_sizes` are this rank's (the layer's
        weight shape); `output_sizes` lists its stacked sub-matrices' rows."""
        super().__init__()
        self.state = state
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.output_sizes = list(output_sizes)
        rank_total = len(output_sizes) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(num_slots + 1, rank_total, input_size, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(num_slots + 1, sum(output_sizes), rank_total, dtype=dtype, device=device),
            persistent=False,
        )

    def add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter product (nothing when the step has none)."""
        token_slots = self.state.token_slots
        if token_slots is None:
            return
        kernel = self.op_kernel
        if kernel is None:
            lora_reference(y, x, self.lora_a, self.lora_b, token_slots)
        else:
            kernel(y, x, token_slots)


def lora_reference(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> None:
    """y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T for s = token_slots[t] != 0,
    in x's dtype. While a graph is captured it reads no host value (every
    slot, masked); otherwise only the slots present run, on their rows."""
    if capturing_any_graph():
        for slot in range(1, lora_a.shape[0]):
            mask = (token_slots == slot).unsqueeze(1).to(x.dtype)
            y.add_(((x @ lora_a[slot].T) @ lora_b[slot].T) * mask)
        return
    for slot in token_slots.unique().tolist():
        if slot == 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)
