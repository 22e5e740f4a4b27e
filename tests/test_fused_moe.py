"""The MoE router and the FusedMoE layer's reference.

The router against transformers' own routers (DeepSeek-V2's group-limited
greedy, DeepSeek-V3's sigmoid scores with a correction bias and grouped
top-k) and hand-computed softmax cases; the layer's reference against a
per-token float64 loop (every token through each of its experts, weighted),
with an expert that gets no token; the loader's per-expert slices at
tensor-parallel rank 0 and 1 of 2, and the checkpoint names the strict
loader expects.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers import fused_moe
from pagedllm.model_registry.layers.fused_moe import (
    MIXTRAL_EXPERT_NAMES,
    FusedMoE,
    apply_activation,
    expert_param_name,
)
from pagedllm.model_registry.layers.moe_router import RouterConfig, select_experts


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


# ---- the router ---------------------------------------------------------------


def test_softmax_top_k_renormalized_or_not() -> None:
    logits = torch.tensor([[math.log(1.0), math.log(2.0), math.log(3.0), math.log(4.0)]])  # p = .1 .2 .3 .4
    weights, ids = select_experts(logits, RouterConfig(4, 2, renormalize=False))
    assert ids.tolist() == [[3, 2]]
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3]]))
    weights, _ = select_experts(logits, RouterConfig(4, 2))
    assert torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7]]))
    weights, _ = select_experts(logits, RouterConfig(4, 2, renormalize=False, routed_scaling_factor=2.5))
    assert torch.allclose(weights, torch.tensor([[1.0, 0.75]]))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_grouped_top_k_keeps_only_the_best_groups() -> None:
    """8 experts in 4 groups of 2 ({0,1} {2,3} {4,5} {6,7}, best scores .8
    .85 .1 .9), the best 2 groups eligible: expert 1 (0.8, the third best
    overall) is out, the top 3 are 7, 2 and 3."""
    probs = torch.tensor([[0.01, 0.8, 0.85, 0.02, 0.1, 0.05, 0.0, 0.9]])
    logits = probs.clamp(min=1e-6).log()
    config = RouterConfig(8, 3, renormalize=False, num_expert_group=4, topk_group=2)
    _, ids = select_experts(logits, config)
    assert sorted(ids[0].tolist()) == [2, 3, 7]


def test_deepseek_v2_group_limited_greedy_matches_transformers() -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf_config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    torch.manual_seed(0)
    router = DeepseekV2TopkRouter(hf_config)
    router.weight.data.normal_(0, 1.0)
    x = torch.randn(40, 32)
    _, hf_weights, hf_ids = router(x)
    config = RouterConfig(16, 4, renormalize=False, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5)
    weights, ids = select_experts(F.linear(x, router.weight), config)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    weights, ids = _sorted_by_id(weights, ids)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, atol=1e-6)
    assert len(set(ids.flatten().tolist())) > 8  # routing varies from token to token


def test_deepseek_v3_sigmoid_bias_and_groups_match_transformers() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(1)
    router = DeepseekV3TopkRouter(hf_config)
    router.weight.data.normal_(0, 1.0)
    router.e_score_correction_bias.normal_(0, 0.5)  # changes which experts win, not their weights
    x = torch.randn(40, 32)
    _, hf_weights, hf_ids = router(x)
    config = RouterConfig(16, 4, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    weights, ids = select_experts(F.linear(x, router.weight), config, router.e_score_correction_bias)
    hf_weights, hf_ids = _sorted_by_id(hf_weights, hf_ids)
    weights, ids = _sorted_by_id(weights, ids)
    assert torch.equal(ids, hf_ids)
    assert torch.allclose(weights, hf_weights, atol=1e-6)
    # Without the bias the choice differs for some token: the bias is used.
    _, unbiased_ids = select_experts(F.linear(x, router.weight), config)
    assert not torch.equal(unbiased_ids.sort(dim=-1)[0], ids)


@pytest.mark.parametrize(("kwargs", "key"), [
    (dict(num_experts=4, top_k=5), "num_experts_per_tok"),
    (dict(num_experts=4, top_k=2, scoring="relu"), "scoring_func"),
    (dict(num_experts=6, top_k=2, num_expert_group=4), "n_group"),
    (dict(num_experts=8, top_k=2, num_expert_group=4, topk_group=5), "topk_group"),
    (dict(num_experts=8, top_k=4, num_expert_group=4, topk_group=1), "topk_group"),
])
def test_router_config_errors_name_the_field(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        RouterConfig(**kwargs)
    assert error.value.key == key


# ---- the layer's reference ------------------------------------------------------


def _random_layer(activation: str, bias: bool, num_experts: int = 6, top_k: int = 2) -> FusedMoE:
    layer = FusedMoE(RouterConfig(num_experts, top_k), 16, 12, bias=bias, activation=activation,
                     swiglu_limit=1.0 if activation == "swigluoai" else None)
    gen = torch.Generator().manual_seed(3)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return layer


def _per_token(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every token through each of its experts, one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            b13 = None if layer.w13_bias is None else layer.w13_bias[e].double()
            b2 = None if layer.w2_bias is None else layer.w2_bias[e].double()
            gate_up = F.linear(x[t].double(), layer.w13_weight[e].double(), b13)
            h = apply_activation(gate_up[None], layer.activation, layer.swiglu_alpha, layer.swiglu_limit)[0]
            out[t] += w * F.linear(h, layer.w2_weight[e].double(), b2)
    return out


@pytest.mark.parametrize(("activation", "bias"), [("silu", False), ("swigluoai", True)])
def test_reference_equals_a_per_token_loop_with_an_idle_expert(activation: str, bias: bool) -> None:
    layer = _random_layer(activation, bias)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 16, generator=gen)
    logits = torch.randn(9, 6, generator=gen)
    logits[:, 4] = -1e4  # expert 4 gets no token
    out = layer(x, logits)
    weights, ids = select_experts(logits, layer.router)
    assert 4 not in ids.flatten().tolist() and len(set(ids.flatten().tolist())) >= 4
    assert torch.allclose(out.double(), _per_token(layer, x, weights, ids), atol=1e-5)
    if activation == "swigluoai":  # the clamp acts on these weights
        gate_up = F.linear(x, layer.w13_weight[0])
        assert gate_up.abs().max() > layer.swiglu_limit


def test_expert_counts_add_up_and_clear() -> None:
    layer = _random_layer("silu", False)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
    layer(torch.randn(5, 16), logits)
    layer(torch.randn(5, 16), logits)
    _, ids = select_experts(logits, layer.router)
    expected = 2 * torch.bincount(ids.flatten(), minlength=6).float()
    assert torch.equal(layer.take_expert_counts(), expected)
    assert float(layer.take_expert_counts().sum()) == 0.0


def test_unknown_activation_and_missing_limit_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="hidden_act"):
        FusedMoE(RouterConfig(4, 2), 8, 8, activation="gelu")
    with pytest.raises(ConfigError, match="swiglu_limit"):
        FusedMoE(RouterConfig(4, 2), 8, 8, activation="swigluoai")


# ---- loading ----------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_weight_loader_takes_this_ranks_slice_of_each_expert(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(fused_moe, "get_tp_group", lambda: SimpleNamespace(rank_in_group=rank, world_size=2))
    layer = FusedMoE(RouterConfig(3, 2), 4, 6, bias=True)  # 3 of the 6 intermediate rows per rank
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    gate_bias, up_bias, down_bias = torch.randn(6), torch.randn(6), torch.randn(4)
    for shard, weight, param in (("w1", gate, layer.w13_weight), ("w3", up, layer.w13_weight),
                                 ("w2", down, layer.w2_weight)):
        layer.weight_loader(param, weight, shard, 2)
    for shard, bias_value, param in (("w1", gate_bias, layer.w13_bias), ("w3", up_bias, layer.w13_bias),
                                     ("w2", down_bias, layer.w2_bias)):
        layer.weight_loader(param, bias_value, shard, 2)
    rows = slice(3 * rank, 3 * rank + 3)
    assert torch.equal(layer.w13_weight[2], torch.cat([gate[rows], up[rows]]))
    assert torch.equal(layer.w2_weight[2], down[:, rows])
    assert torch.equal(layer.w13_bias[2], torch.cat([gate_bias[rows], up_bias[rows]]))  # type: ignore[index]
    # The down bias once over the ranks' sum: on rank 0 only.
    assert torch.equal(layer.w2_bias[2], down_bias if rank == 0 else torch.zeros(4))  # type: ignore[index]
    assert float(layer.w13_weight[0].abs().sum()) == 0.0  # other experts untouched
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight_loader(layer.w13_weight, torch.randn(5, 4), "w1", 0)
    with pytest.raises(ValueError, match="expert 3"):
        layer.weight_loader(layer.w13_weight, gate, "w1", 3)


def test_checkpoint_names_and_their_parameters() -> None:
    assert expert_param_name("model.layers.0.mlp.experts.3.up_proj.weight") == (
        "model.layers.0.mlp.experts.w13_weight", "w3", 3)
    assert expert_param_name("model.layers.1.block_sparse_moe.experts.0.w2.weight", MIXTRAL_EXPERT_NAMES) == (
        "model.layers.1.block_sparse_moe.experts.w2_weight", "w2", 0)
    assert expert_param_name("model.layers.0.mlp.gate.weight") is None
    assert expert_param_name("model.layers.0.mlp.experts.3.w1.weight") is None  # not a Qwen name
    layer = FusedMoE(RouterConfig(2, 1), 4, 4, expert_names=MIXTRAL_EXPERT_NAMES)
    assert layer.checkpoint_names() == {
        "w13_weight": ["0.w1.weight", "0.w3.weight", "1.w1.weight", "1.w3.weight"],
        "w2_weight": ["0.w2.weight", "1.w2.weight"],
    }
