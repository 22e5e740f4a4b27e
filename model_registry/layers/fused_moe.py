"""The mixture-of-experts layer: routed experts as one op (vLLM's FusedMoE).

Each of E experts is a gated MLP: h = act(x W1^T + b1, x W3^T + b3),
y = h W2^T + b2 (W1 the gate, W3 the up projection, W2 the down one, in
nn.Linear's [out, in] layout). A token's output is the sum over its top-k
experts of weight * y (the router, moe_router.py, picks them). Storage
(vLLM's): `w13_weight` [E, 2 * I, H] with each expert's gate rows then its
up rows, `w2_weight` [E, H, I], and with `bias` `w13_bias` [E, 2 * I] and
`w2_bias` [E, H].

Activations (`activation`):
- "silu": SwiGLU, silu(gate) * up (Mixtral, Qwen-MoE, DeepSeek);
- "swigluoai": GPT-OSS's, gate clamped from above and up both ways at
  `swiglu_limit`, then (up + 1) * gate * sigmoid(alpha * gate).

The expert computation is the "fused_moe" op of the op registry (ops.py):
the platform supplies its kernel (the CPU's grouped bfloat16 GEMMs and its
decode kernel, the Triton fused-MoE kernel on CUDA), and the layer's own
torch code below is the reference they are tested against: tokens grouped
by expert, one pair of matmuls per expert that has any. Its routing reads
host values, so a step that runs it is never captured as a graph; a kernel
that reads the routing from tensors only may be.

Tensor parallel (vLLM's default for MoE): every rank holds every expert,
each a 1/tp slice of the intermediate dimension (W1 and W3 rows, W2
columns), so each rank's output is a partial sum and one all-reduce after
the layer completes it (`reduce_results`; a model that adds a shared
expert's partial sum first reduces once for both). `w2_bias` is loaded on
rank 0 only (zeros elsewhere), so the reduction adds it once.

Expert parallel (`parallel.enable_expert_parallel`, expert_parallel.py):
each rank of the expert-parallel group holds E / ep whole experts (its
`num_local_experts`, `expert_map` global -> local, -1 elsewhere; the
loader skips the other ranks' experts, biases included, without reading
them), and the tokens travel to their experts and back in all-to-alls; the
bound kernel runs on the local experts alone.

The layer counts the tokens routed to each expert (`expert_counts`, a
float32 tensor updated in place so a graph replay updates it too) for the
expert-load statistics; `take_expert_counts()` returns and clears them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.parallel_state import get_ep_group, get_tp_group
from pagedllm.model_registry.layers.expert_parallel import ExpertPlacement, expert_parallel_moe, place_experts
from pagedllm.model_registry.layers.linear import copy_shard
from pagedllm.model_registry.layers.moe_router import RouterConfig, select_experts
from pagedllm.model_registry.layers.ops import FUSED_MOE, OpLayer
from pagedllm.model_registry.layers.tp_heads import divide
from pagedllm.platforms.cpu.graph import refuse_capture

ACTIVATIONS = ("silu", "swigluoai")
# Checkpoint shard names of one expert's matrices (vLLM's): gate, down, up.
EXPERT_SHARDS = ("w1", "w2", "w3")


# Per-expert checkpoint tensors: `<layer>.experts.<e>.<matrix>.<weight|bias>`.
_EXPERT_TENSOR = re.compile(
    r"^(?P<layer>.*\.experts)\.(?P<expert>\d+)\.(?P<matrix>[A-Za-z0-9_]+)\.(?P<kind>weight|bias)$"
)
# Each family's names of an expert's gate, down and up matrices.
QWEN_EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # Qwen-MoE, DeepSeek
MIXTRAL_EXPERT_NAMES = {"w1": "w1", "w2": "w2", "w3": "w3"}


def apply_activation(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate columns, then up columns) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class FusedMoE(nn.Module, OpLayer):
    op_name = FUSED_MOE
    expert_counts: torch.Tensor

    def __init__(
        self,
        router: RouterConfig,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = None,
        reduce_results: bool = True,
        expert_names: dict[str, str] | None = None,
        stacked_names: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        """`expert_names`: the checkpoint's names of an expert's matrices
        -> shard id (default QWEN_EXPERT_NAMES: `experts.<e>.gate_proj`
        ...); `stacked_names`: instead, parameter -> the checkpoint tensors
        holding every expert's (GPT-OSS: one float tensor, or MXFP4 blocks
        and scales), which the model loads."""
        super().__init__()
        self.expert_names = expert_names or QWEN_EXPERT_NAMES
        self.stacked_names = stacked_names
        if activation not in ACTIVATIONS:
            raise ConfigError("hidden_act", activation, f"one of {', '.join(ACTIVATIONS)} for expert MLPs")
        if activation == "swigluoai" and swiglu_limit is None:
            raise ConfigError("swiglu_limit", swiglu_limit, "a positive number for the swigluoai activation")
        self.router = router
        self.num_experts = router.num_experts
        self.top_k = router.top_k
        self.hidden_size = hidden_size
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.ep_group = get_ep_group()
        # Expert parallel: whole experts here, none sliced (this layer's own TP is 1).
        self.placement: ExpertPlacement | None = None
        self.moe_tp_rank, self.moe_tp_size = self.tp_rank, self.tp_size
        if self.ep_group is not None:
            self.placement = place_experts(self.num_experts, self.ep_group.rank_in_group, self.ep_group.world_size)
            self.moe_tp_rank, self.moe_tp_size = 0, 1
        self.num_local_experts = self.num_experts if self.placement is None else self.placement.num_local_experts
        # Global expert id -> its index in this rank's parameters, -1 for another rank's.
        self.expert_map = (list(range(self.num_experts)) if self.placement is None
                           else self.placement.expert_map)
        self.intermediate_size = intermediate_size  # the whole, as the checkpoint holds it
        self.intermediate_size_per_partition = divide(intermediate_size, self.moe_tp_size, "moe_intermediate_size")
        self.activation = activation
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = math.inf if swiglu_limit is None else swiglu_limit
        self.reduce_results = reduce_results
        num_experts, inter = self.num_local_experts, self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(num_experts, hidden_size, inter), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False) if bias else None
        for param in self.parameters():
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.register_buffer("expert_counts", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> FusedMoE:
        super()._apply(fn, recurse)
        # NOTE: the counts stay float32 when the model is cast (`.to(bfloat16)`
        # by a model's constructor): bfloat16 stops counting exactly at 256.
        if self.expert_counts.dtype != torch.float32:
            self.expert_counts = self.expert_counts.float()
        return self

    # ------------------------------------------------------------- loading

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        """One expert's checkpoint matrix (or bias): its gate ("w1") or up
        ("w3") projection [I, H] into its w13 rows, its down projection
        ("w2") [H, I] into its w2; this rank's slice of the intermediate
        dimension of each (tensor parallel), or the whole of an expert this
        rank holds and nothing of another's (expert parallel)."""
        if shard_id not in EXPERT_SHARDS:
            raise ValueError(f"expert shard {shard_id!r}: one of {', '.join(EXPERT_SHARDS)}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id}: the layer has {self.num_experts}")
        local_id = self.expert_map[expert_id]
        if local_id < 0:  # another rank's expert: never read (the tensor stays memory-mapped)
            return
        inter, tp_rank = self.intermediate_size_per_partition, self.moe_tp_rank
        expert = param.data[local_id]
        if shard_id == "w2":
            if param is self.w2_bias:  # added once: by rank 0's partial sum (every rank's own under EP)
                copy_shard(expert, loaded_weight if tp_rank == 0 else torch.zeros_like(loaded_weight))
            else:
                copy_shard(expert, loaded_weight, 1, tp_rank * inter, self.intermediate_size)
            return
        rows = expert.narrow(0, 0 if shard_id == "w1" else inter, inter)
        copy_shard(rows, loaded_weight, 0, tp_rank * inter, self.intermediate_size)

    # ------------------------------------------------------------- forward

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, H], [T, E] -> [T, H]
        topk_weights, topk_ids = select_experts(router_logits, self.router, correction_bias)
        self.expert_counts.index_add_(
            0, topk_ids.flatten(), torch.ones(1, dtype=torch.float32, device=x.device).expand(topk_ids.numel())
        )
        if self.placement is not None and self.ep_group is not None:
            # NOTE: with reduce_results=False the caller's all-reduce gathers the shares.
            return expert_parallel_moe(x, topk_weights, topk_ids, self.ep_group, self.placement,
                                       self._run_local_experts, gather=self.reduce_results)
        out = self.apply_experts(x, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out

    def _run_local_experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel: each received row through its one local expert,
        weight 1 (the owner of the token weights it)."""
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self.apply_experts(rows, ones, local_ids.unsqueeze(1))

    def apply_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's sum over each token's experts (the bound "fused_moe"
        kernel, else the reference)."""
        kernel = self.op_kernel
        if kernel is not None:
            return kernel(x, topk_weights, topk_ids)
        return self.forward_reference(x, topk_weights, topk_ids)

    def forward_reference(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The plain-torch reference: for each expert with tokens, its
        tokens' rows through its two matmuls, weighted and summed in float32."""
        def gate_up(expert: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, self.w13_weight[expert], None if self.w13_bias is None else self.w13_bias[expert])

        def down(expert: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(rows, self.w2_weight[expert], None if self.w2_bias is None else self.w2_bias[expert])

        return self.sum_over_experts(x, topk_weights, topk_ids, gate_up, down)

    def sum_over_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        gate_up: Callable[[int, torch.Tensor], torch.Tensor],
        down: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The reference's routing with the expert matmuls supplied: tokens
        grouped by expert, `gate_up(e, rows)` [n, H] -> [n, 2I] (bias
        included), the activation, `down(e, h)` [n, I] -> [n, H], weighted
        and summed in float32. A kernel that only stores the weights
        differently (int8, quantization/int8.py) reuses it."""
        refuse_capture("the reference MoE routes tokens with host-side indices")
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        flat_ids = topk_ids.flatten()  # local expert ids (the global ones without expert parallelism)
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_local_experts).tolist()
        token_of = order // topk_ids.shape[1]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            h = apply_activation(gate_up(expert, x[tokens]), self.activation, self.swiglu_alpha, self.swiglu_limit)
            y = down(expert, h)
            out.index_add_(0, tokens, y.float() * topk_weights.flatten()[slots, None])
        return out.to(x.dtype)

    def checkpoint_names(self) -> dict[str, list[str]]:
        """Parameter -> the checkpoint tensors that fill it, names relative
        to the layer (what the strict loader expects; model_registry/loader.py)."""
        if self.stacked_names is not None:
            return {name: list(self.stacked_names[name]) for name, _ in self.named_parameters()}
        by_shard = {shard: matrix for matrix, shard in self.expert_names.items()}
        names: dict[str, list[str]] = {}
        for param_name, _ in self.named_parameters():
            stack, kind = param_name.split("_", 1)  # "w13", "weight"
            shards = ("w1", "w3") if stack == "w13" else ("w2",)
            names[param_name] = [f"{e}.{by_shard[shard]}.{kind}" for e in range(self.num_experts) for shard in shards]
        return names

    def take_expert_counts(self) -> torch.Tensor:
        """Tokens routed to each expert since the last call (float32 [E]), and clear."""
        counts = self.expert_counts.clone()
        self.expert_counts.zero_()
        return counts

    def extra_repr(self) -> str:
        local = "" if self.placement is None else f" ({self.num_local_experts} here)"
        return (f"experts={self.num_experts}{local}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition} (of {self.intermediate_size}), "
                f"activation={self.activation}")


def expert_param_name(name: str, matrix_names: dict[str, str] = QWEN_EXPERT_NAMES) -> tuple[str, str, int] | None:
    """(FusedMoE parameter, shard id, expert id) of a per-expert checkpoint
    tensor, the FusedMoE module being named `experts`:
    'model.layers.0.mlp.experts.3.up_proj.weight' ->
    ('model.layers.0.mlp.experts.w13_weight', 'w3', 3); None for any other name."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["matrix"] not in matrix_names:
        return None
    shard_id = matrix_names[match["matrix"]]
    return f"{match['layer']}.{'w2' if shard_id == 'w2' else 'w13'}_{match['kind']}", shard_id, int(match["expert"])
