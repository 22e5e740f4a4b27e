"""A mixture-of-experts router: which experts each token goes to, and with
what weights (vLLM's `select_experts`; the variants of the families served).

- softmax scoring (Mixtral, Qwen2/3-MoE, GPT-OSS): probabilities over all
  experts, the top k kept, renormalised to sum to 1 when `renormalize`
  (Qwen's `norm_topk_prob`; Mixtral always; GPT-OSS's softmax over the top-k
  logits is the same thing).
- sigmoid scoring (DeepSeek-V3): each expert's score on its own; a
  `correction_bias` (the checkpoint's `e_score_correction_bias`) is added for
  choosing the experts only, the weights are the unbiased scores.
- grouped top-k (DeepSeek's `n_group` / `topk_group`): the experts form
  `num_expert_group` equal groups, only the best `topk_group` groups are
  eligible. A group's score is its best expert's (DeepSeek-V2's
  group-limited greedy) or, with a correction bias, the sum of its two best
  biased scores (DeepSeek-V3's noaux_tc).
- `routed_scaling_factor` multiplies the weights last (DeepSeek).

Weights are float32 whatever the activations' dtype: the router's softmax
runs in float32 in every reference implementation, and the experts'
weighted sum is formed in float32 by the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.linear import ReplicatedLinear

SCORING_FUNCS = ("softmax", "sigmoid")


class RouterLinear(ReplicatedLinear):
    """A router's (or a shared expert's gate's) linear layer: whole on every
    rank, and left in float by quantization (`skip_quantization`): int8
    rounding of a few logits per token flips which experts run."""

    skip_quantization = True


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None  # None or 1: no groups
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ConfigError("scoring_func", self.scoring, f"one of {', '.join(SCORING_FUNCS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError("num_experts_per_tok", self.top_k, f"1..num_experts ({self.num_experts})")
        groups = self.num_expert_group or 1
        if self.num_experts % groups:
            raise ConfigError("n_group", groups, f"a divisor of the number of experts ({self.num_experts})")
        if groups > 1:
            topk_group = self.topk_group or groups
            if not 1 <= topk_group <= groups:
                raise ConfigError("topk_group", self.topk_group, f"1..n_group ({groups})")
            if topk_group * (self.num_experts // groups) < self.top_k:
                raise ConfigError(
                    "topk_group", self.topk_group,
                    f"enough groups to hold num_experts_per_tok ({self.top_k}) experts",
                )


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    config: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int64 [T, k]) for each token."""
    logits = router_logits.float()
    groups = config.num_expert_group or 1
    if config.scoring == "softmax" and config.renormalize and groups == 1 and correction_bias is None:
        # The softmax over all experts, renormalised over the top k, is the
        # softmax of the top k logits: three operations instead of six (a
        # decode graph replays each; Qwen-MoE and Mixtral route this way).
        top_logits, topk_ids = torch.topk(logits, config.top_k, dim=-1)
        topk_weights = torch.softmax(top_logits, dim=-1)
        if config.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * config.routed_scaling_factor
        return topk_weights, topk_ids
    scores = torch.softmax(logits, dim=-1) if config.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if groups > 1:
        choice = _mask_unselected_groups(choice, groups, config.topk_group or groups, correction_bias is not None)
    _, topk_ids = torch.topk(choice, config.top_k, dim=-1)
    topk_weights = scores.gather(1, topk_ids)
    if config.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * config.routed_scaling_factor
    return topk_weights, topk_ids


def _mask_unselected_groups(choice: torch.Tensor, groups: int, topk_group: int, top2_sum: bool) -> torch.Tensor:
    """`choice` with the experts outside each token's best `topk_group`
    groups set to -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, groups, num_experts // groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if top2_sum else grouped.amax(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
    return choice.masked_fill(~keep.repeat_interleave(num_experts // groups, dim=1), float("-inf"))
