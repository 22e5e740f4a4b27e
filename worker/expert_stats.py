"""Expert-load statistics of a mixture-of-experts model: custom figures
(core/custom_stats.py) of a rank component, so that an operator sees how
evenly the router spreads tokens over the experts.

Each FusedMoE layer counts the tokens it routes to each of its experts
(`FusedMoE.expert_counts`, model_registry/layers/fused_moe.py). After every
step, rank 0 (every rank routes alike: the router is replicated) takes
those counts and reports:

- `moe_expert_tokens` (histogram): one observation per MoE layer and expert
  per step, the tokens that layer routed to that expert in the step. Its
  sum is every token-expert assignment (tokens x top_k x MoE layers) and
  its mean what a perfectly balanced router gives each expert; the spread
  of the buckets around it is the imbalance. Per layer, not summed over
  layers: expert e of one layer has nothing to do with expert e of another.
- `moe_routed_tokens` (counter): the token-expert assignments since start.
- `moe_expert_load_imbalance` (gauge): in the last step, the busiest
  expert's tokens over the mean per expert, in the layer where that ratio
  is largest (1: balanced; the number of experts / top_k: one group of
  top_k experts took every token).

Only a model with MoE layers declares them (the builder asks rank 0,
`Worker.model_custom_metrics`). The counts cover the target model's
forwards while serving (the profile run's and graph captures' are cleared
when the component is built); a forward replayed from a decode graph
counts its padding rows too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.core.custom_stats import MetricSpec, MetricType
from pagedllm.model_registry.layers.fused_moe import FusedMoE

if TYPE_CHECKING:
    from torch import nn

# 0, then powers of two up to 65536 tokens per expert per step.
EXPERT_TOKEN_BUCKETS = [0.0] + [float(2**i) for i in range(17)]


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    return [module for module in model.modules() if isinstance(module, FusedMoE)]


class ExpertLoadStats:
    """The expert-load figures of `model`'s MoE layers (build it only when
    `moe_layers(model)` has any)."""

    custom_metrics = (
        MetricSpec(
            "moe_expert_tokens", MetricType.HISTOGRAM,
            "Tokens an MoE layer routed to one expert in one step (one observation per layer and expert per step).",
            buckets=EXPERT_TOKEN_BUCKETS,
        ),
        MetricSpec("moe_routed_tokens", MetricType.COUNTER,
                   "Token-expert assignments of the MoE layers (tokens x top_k x MoE layers)."),
        MetricSpec("moe_expert_load_imbalance", MetricType.GAUGE,
                   "Last step's busiest expert over the mean per expert, in its most unbalanced MoE layer."),
    )

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self.num_routed = 0
        self.take_counts()  # what forwards before serving counted (the profile run, graph captures)

    def take_counts(self) -> list[torch.Tensor]:
        """Each layer's tokens per expert since the last call, on the host."""
        # NOTE: joined on the device first: one copy to the host per step, not one per layer.
        counts = torch.cat([layer.take_expert_counts() for layer in self.layers]).cpu()
        return list(counts.split([layer.num_experts for layer in self.layers]))

    def get_custom_stats(self) -> dict[str, float | list[float]]:
        per_layer = [counts.tolist() for counts in self.take_counts()]
        step_routed = int(sum(sum(counts) for counts in per_layer))
        self.num_routed += step_routed
        figures: dict[str, float | list[float]] = {"moe_routed_tokens": float(self.num_routed)}
        if step_routed == 0:  # no forward ran: nothing observed, the gauge keeps its value
            figures["moe_expert_tokens"] = []
            return figures
        figures["moe_expert_tokens"] = [count for counts in per_layer for count in counts]
        figures["moe_expert_load_imbalance"] = max(
            max(counts) * len(counts) / sum(counts) for counts in per_layer if sum(counts) > 0
        )
        return figures


__all__ = ["EXPERT_TOKEN_BUCKETS", "ExpertLoadStats", "moe_layers"]
