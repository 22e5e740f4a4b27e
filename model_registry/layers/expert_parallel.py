"""Expert parallelism for the FusedMoE layer (vLLM's `--enable-expert-parallel`).

With it, the E routed experts of a layer are placed whole on the ranks of
the expert-parallel group (here the tensor parallel group's ranks): rank r
holds experts [r * E / ep, (r + 1) * E / ep), contiguously, and
`expert_map` [E] gives each global expert its local index there (-1 on
every other rank). Attention and the dense layers stay tensor parallel.

A step through an expert-parallel layer (`expert_parallel_moe`):

1. After attention every rank holds the same T tokens and computes the
   same routing; each rank takes its token share, a contiguous 1/ep of the
   rows (sequence split; ceil(T / ep) rows, the last shares shorter or empty).
2. Dispatch: the share's (token, slot) pairs sorted by global expert, which
   is also by destination rank (`plan_dispatch`); one all-to-all of the
   per-expert pair counts tells every rank how many rows of which local
   expert it will receive from each rank, one all-to-all moves the rows.
3. Each rank runs its local experts on what it received (the layer's
   "fused_moe" kernel on its local experts, each row one pair of top-1 with
   weight 1, or the reference).
4. Combine: one all-to-all sends each result back to the rank that owns
   the token; there each token's weighted sum over its k experts is formed
   in float32 (`index_add_`, in expert order as the reference sums).
5. An all-gather of the shares gives every rank the whole [T, H] output
   again, or, for a layer whose caller all-reduces (`reduce_results=False`,
   Qwen2-MoE's shared expert), the share in place and zeros elsewhere, so the
   caller's all-reduce is the gather.

Communication per layer: 3 all-to-alls and 1 all-gather, whose volume is
about T * k * H / ep rows each way and T * H for the gather, against tensor
parallelism's one all-reduce of T * H (with every rank computing every
token on 1/ep of each expert). The counts decide the message sizes on the
host, so a step that runs it is never captured as a graph (eager only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.platforms.cpu.graph import refuse_capture

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagedllm.distributed.group_coordinator import GroupCoordinator

EP_FIELD = "parallel.enable_expert_parallel"
# Where the families' configs keep their number of routed experts.
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_routed_experts(hf_config: object) -> int | None:
    """The model's routed experts per MoE layer; None for a dense model."""
    for key in NUM_EXPERTS_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class ExpertPlacement(NamedTuple):
    """Which experts one rank holds."""

    ep_rank: int
    ep_size: int
    num_local_experts: int
    first_expert: int  # global id of local expert 0

    @property
    def expert_map(self) -> list[int]:
        """Global expert id -> local index on this rank, -1 elsewhere (vLLM's)."""
        num_experts = self.num_local_experts * self.ep_size
        return [e - self.first_expert if self.first_expert <= e < self.first_expert + self.num_local_experts
                else -1 for e in range(num_experts)]


def place_experts(num_experts: int, ep_rank: int, ep_size: int) -> ExpertPlacement:
    """Rank `ep_rank`'s contiguous 1/ep of the experts; a ConfigError when
    the experts do not split evenly over the ranks."""
    if num_experts % ep_size:
        raise ConfigError(
            EP_FIELD, True,
            f"False, or a tensor_parallel_size that divides the model's number of experts ({num_experts}); "
            f"{ep_size} ranks do not",
        )
    per_rank = num_experts // ep_size
    return ExpertPlacement(ep_rank, ep_size, per_rank, ep_rank * per_rank)


def token_share(num_tokens: int, ep_rank: int, ep_size: int) -> tuple[int, int, int]:
    """(start, stop, rows per share) of rank `ep_rank`'s rows: shares of
    ceil(T / ep) rows, the last ones shorter or empty."""
    rows = -(-num_tokens // ep_size)
    start = min(ep_rank * rows, num_tokens)
    return start, min(start + rows, num_tokens), rows


class DispatchPlan(NamedTuple):
    """Where one share's token-expert pairs go (pair p = token * k + slot)."""

    order: torch.Tensor  # int64 [P]: pair ids sorted by global expert (stable), so by destination rank
    expert_counts: torch.Tensor  # int64 [E]: pairs sent to each global expert
    send_counts: list[int]  # pairs sent to each rank


def plan_dispatch(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> DispatchPlan:
    """The dispatch of a share's pairs (`topk_ids` [S, k] global ids),
    experts placed contiguously over `ep_size` ranks."""
    flat_ids = topk_ids.flatten()
    expert_counts = torch.bincount(flat_ids, minlength=num_experts)
    send_counts = expert_counts.view(ep_size, num_experts // ep_size).sum(dim=1).tolist()
    return DispatchPlan(flat_ids.argsort(stable=True), expert_counts, send_counts)


def received_local_ids(recv_expert_counts: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the local expert of each received row, from the counts
    [ep, E_local] each rank sent (each rank's rows arrive sorted by expert)."""
    ep_size, num_local = recv_expert_counts.shape
    local_ids = torch.arange(num_local, device=recv_expert_counts.device).repeat(ep_size)
    return local_ids.repeat_interleave(recv_expert_counts.flatten())


def expert_parallel_moe(
    x: torch.Tensor,  # [T, H], the same on every rank
    topk_weights: torch.Tensor,  # float32 [T, k]
    topk_ids: torch.Tensor,  # int64 [T, k], global expert ids
    group: GroupCoordinator,
    placement: ExpertPlacement,
    run_local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    gather: bool = True,
) -> torch.Tensor:
    """The layer's output [T, H] (see the module docstring); with
    `gather=False` this rank's share of the rows, zeros elsewhere.
    `run_local_experts(rows [N, H], local_ids [N])` -> [N, H]: each row
    through its one local expert, unweighted."""
    refuse_capture("expert parallelism sizes its all-to-alls from host-side counts")
    num_tokens, top_k = topk_ids.shape
    ep_size, num_local = placement.ep_size, placement.num_local_experts
    start, stop, rows_per_share = token_share(num_tokens, placement.ep_rank, ep_size)
    plan = plan_dispatch(topk_ids[start:stop], num_local * ep_size, ep_size)
    token_of = plan.order // top_k  # within the share
    # Dispatch: the counts first (every rank learns what it receives), then the rows.
    recv_expert_counts = group.all_to_all(plan.expert_counts, [num_local] * ep_size, [num_local] * ep_size)
    recv_expert_counts = recv_expert_counts.view(ep_size, num_local)
    recv_counts = recv_expert_counts.sum(dim=1).tolist()
    recv_rows = group.all_to_all(x[start:stop].index_select(0, token_of), recv_counts, plan.send_counts)
    local_ids = received_local_ids(recv_expert_counts)
    y = run_local_experts(recv_rows, local_ids) if local_ids.numel() else recv_rows
    # Combine: results back to the share's owner, weighted and summed per token in float32.
    returned = group.all_to_all(y, plan.send_counts, recv_counts)
    weights = topk_weights[start:stop].flatten().index_select(0, plan.order).unsqueeze(-1)
    share = torch.zeros(stop - start, x.shape[1], dtype=torch.float32, device=x.device)
    share = share.index_add_(0, token_of, returned.float() * weights).to(x.dtype)
    if not gather:
        out = torch.zeros_like(x)
        out[start:stop] = share
        return out
    padded = torch.zeros(rows_per_share, x.shape[1], dtype=x.dtype, device=x.device)
    padded[: stop - start] = share
    return group.all_gather(padded, dim=0)[:num_tokens]
