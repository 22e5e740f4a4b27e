"""Expert-load statistics (issue 34): an MoE model's rank 0 reports the
tokens each layer routed to each expert per step as custom figures
(worker/expert_stats.py), which reach the stat loggers and /metrics; a
dense model declares none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_models_gpt_oss import build_gpt_oss

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig
from pagedllm.worker.expert_stats import ExpertLoadStats

PROMPT_LENS = (5, 11, 19)
MAX_TOKENS = 6
NUM_MOE_LAYERS, TOP_K, NUM_EXPERTS = 2, 2, 4  # the tiny GPT-OSS's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "model")


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "decode-graphs"])
def test_the_expert_counts_sum_to_tokens_times_top_k_times_moe_layers(checkpoint: Path, enforce_eager: bool) -> None:
    """Eager: exactly tokens x top_k x MoE layers. With decode graphs the
    padding rows of each replay are routed and counted too: the 5 decode
    steps of 3 requests replay the 4-row graph, one padding row each."""
    llm = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False,
              stat_loggers=["prometheus"], enforce_eager=enforce_eager)
    try:
        assert [spec.name for spec in llm.engine_core.ready.custom_metrics] == [
            spec.name for spec in ExpertLoadStats.custom_metrics]
        prompts = [{"prompt_token_ids": [8 + (3 * i + j) % 400 for j in range(n)]} for i, n in enumerate(PROMPT_LENS)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),  # type: ignore[arg-type]
                     use_tqdm=False)
        assert llm.stat_logger is not None
        samples = _samples(llm.stat_logger.render().decode())
    finally:
        llm.shutdown()
    # Every prompt token, and every generated token but the last, ran once.
    num_tokens = sum(PROMPT_LENS) + len(PROMPT_LENS) * (MAX_TOKENS - 1)
    assert samples[("pagedllm:iteration_tokens_total_sum", frozenset())] == num_tokens
    num_steps = samples[("pagedllm:iteration_tokens_total_count", frozenset())]
    padding_rows = 0 if enforce_eager else MAX_TOKENS - 1
    routed = (num_tokens + padding_rows) * TOP_K * NUM_MOE_LAYERS
    assert samples[("pagedllm:moe_routed_tokens_total", frozenset())] == routed
    assert samples[("pagedllm:moe_expert_tokens_sum", frozenset())] == routed
    # One observation per layer and expert per step.
    assert samples[("pagedllm:moe_expert_tokens_count", frozenset())] == num_steps * NUM_MOE_LAYERS * NUM_EXPERTS
    # The last step decoded one token per request: 3 tokens x top-2 over 4
    # experts, the busiest holding between the mean (1.5) and every token (3).
    assert 1.0 <= samples[("pagedllm:moe_expert_load_imbalance", frozenset())] <= 3 / 1.5


def test_the_figures_are_each_layers_counts_per_step() -> None:
    layers = torch.nn.ModuleList(
        FusedMoE(RouterConfig(NUM_EXPERTS, TOP_K), 8, 8) for _ in range(NUM_MOE_LAYERS))
    layers[0].expert_counts += 5.0  # a forward before serving (the profile run): not reported
    stats = ExpertLoadStats(layers)
    # Layer 0 sent 3 tokens to experts 0 and 1, layer 1 6 slots mostly to expert 2.
    layers[0].expert_counts.copy_(torch.tensor([3.0, 3.0, 0.0, 0.0]))
    layers[1].expert_counts.copy_(torch.tensor([0.0, 1.0, 4.0, 1.0]))
    assert stats.get_custom_stats() == {
        "moe_routed_tokens": 12.0,
        "moe_expert_tokens": [3.0, 3.0, 0.0, 0.0, 0.0, 1.0, 4.0, 1.0],
        "moe_expert_load_imbalance": 4.0 / 1.5,
    }
    # Taken: the next step starts from zero; a step without forwards observes nothing.
    assert stats.get_custom_stats() == {"moe_routed_tokens": 12.0, "moe_expert_tokens": []}


def test_a_dense_model_declares_no_expert_figures() -> None:
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=64)
    try:
        assert llm.engine_core.ready.custom_metrics == []
        assert llm.engine_core.engine_core.custom_stats is None  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
