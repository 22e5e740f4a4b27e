"""Expert parallelism (`--enable-expert-parallel`): the MoE layers place
whole experts on the tensor-parallel ranks and exchange tokens all-to-all.

- The dispatch plan (which token-expert pairs go to which rank, which local
  expert each received row is for, each rank's token share) against
  hand-computed values; the placement's ConfigError.
- Two gloo ranks (plain processes) load Qwen3-MoE, Qwen2-MoE (its shared
  expert: the caller's all-reduce gathers the shares) and GPT-OSS (expert
  biases, every rank's own) with expert parallelism: their paged batches'
  logits equal transformers' (float32), with the reference and with the CPU
  "fused_moe" kernel bound to the local experts; each rank holds exactly
  its half of the experts (bytes and values) and the all-to-alls ran.
- The engine at -tp 2 with expert parallelism on Ray: greedy tokens equal
  transformers' `generate` (on the mp executor, with prefix hits, chunked
  prefill, preemption and drafts, for every MoE architecture:
  tests/test_models_engine_matrix.py).
- What the flag does with a dense model (nothing, as vLLM) and with experts
  that do not split over the ranks (a ConfigError before any rank starts).
"""

from __future__ import annotations

import os

# NOTE: before Ray is imported anywhere: Ray then binds 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.expert_parallel import (
    EP_FIELD,
    place_experts,
    plan_dispatch,
    received_local_ids,
    token_share,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> architecture of the rank test's checkpoints
RANK_MODELS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


# ---- the plan, by hand --------------------------------------------------------------


def test_dispatch_plan_sends_each_pair_to_the_rank_of_its_expert() -> None:
    # A share of 3 tokens, top-2 of 4 experts over 2 ranks (experts 0-1 on rank 0, 2-3 on rank 1).
    topk_ids = torch.tensor([[3, 0], [1, 2], [2, 3]])
    plan = plan_dispatch(topk_ids, num_experts=4, ep_size=2)
    # Pairs (token * 2 + slot) by expert: e0 <- pair 1; e1 <- 2; e2 <- 3, 4; e3 <- 0, 5.
    assert plan.order.tolist() == [1, 2, 3, 4, 0, 5]
    assert plan.expert_counts.tolist() == [1, 1, 2, 2]
    assert plan.send_counts == [2, 4]
    assert (plan.order // 2).tolist() == [0, 1, 1, 2, 0, 2]  # the token each sent row is


def test_received_rows_know_their_local_expert_from_the_counts() -> None:
    # From rank 0: 1 row for local expert 0, none for 1; from rank 1: 2 for expert 0, 1 for expert 1.
    assert received_local_ids(torch.tensor([[1, 0], [2, 1]])).tolist() == [0, 0, 0, 1]
    assert received_local_ids(torch.zeros(2, 3, dtype=torch.int64)).tolist() == []


def test_token_shares_split_the_rows_contiguously() -> None:
    assert [token_share(5, r, 2) for r in range(2)] == [(0, 3, 3), (3, 5, 3)]
    assert [token_share(1, r, 2) for r in range(2)] == [(0, 1, 1), (1, 1, 1)]  # a decode of one: rank 1 idle
    assert [token_share(4, r, 4) for r in range(4)] == [(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)]


def test_placement_and_expert_map() -> None:
    placement = place_experts(8, 1, 2)
    assert (placement.num_local_experts, placement.first_expert) == (4, 4)
    assert placement.expert_map == [-1, -1, -1, -1, 0, 1, 2, 3]
    with pytest.raises(ConfigError) as err:
        place_experts(6, 0, 4)
    assert err.value.key == EP_FIELD
    assert "number of experts (6)" in str(err.value)


# ---- two ranks, the models ------------------------------------------------------------


def _checkpoint(architecture: str, folder: Path) -> Path:
    if architecture == "GptOssForCausalLM":
        from test_models_gpt_oss import build_gpt_oss

        return build_gpt_oss(folder / "model")
    from test_models_moe import build_moe

    return build_moe(architecture, folder / "model")


def _model_class(architecture: str) -> Any:
    from pagedllm.model_registry.models.gpt_oss import GptOssForCausalLM
    from pagedllm.model_registry.models.qwen2_moe import Qwen2MoeForCausalLM
    from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeForCausalLM

    return {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
            "GptOssForCausalLM": GptOssForCausalLM}[architecture]


def _load(architecture: str, path: Path) -> Any:
    from pagedllm.attention_backends.torch_native import TorchNativeBackend
    from pagedllm.model_registry.loader import load_model

    return load_model(path, model_cls=_model_class(architecture), attn_backend=TorchNativeBackend,
                      dtype=torch.float32, device="cpu")


def _run_batches(model: Any) -> dict[str, Any]:
    """Three prompts prefilled together (39 rows: uneven shares), decodes of
    three and of one request (rank 1's share empty), a chunked prompt."""
    from test_models import PagedBatchRunner

    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    runner = PagedBatchRunner(model)
    for length in (5, 13, 21):
        runner.add_request(torch.randint(8, vocab, (length,), generator=gen).tolist())
    runner.step([(0, 5), (1, 13), (2, 21)])
    runner.step([(0, 1), (1, 1), (2, 1)])
    runner.step([(1, 1)])
    late = runner.add_request(torch.randint(8, vocab, (19,), generator=gen).tolist())
    runner.step([(0, 1), (late, 8), (2, 1)])
    runner.step([(late, 11), (1, 1)])
    return {"tokens": runner.tokens, "num_computed": runner.num_computed, "logits": runner.logits}


def _expert_bytes(model: Any) -> int:
    from pagedllm.model_registry.layers.fused_moe import FusedMoE

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, FusedMoE)
               for p in m.parameters())


def _first_experts(model: Any) -> Any:
    from pagedllm.model_registry.layers.fused_moe import FusedMoE

    return next(m for m in model.modules() if isinstance(m, FusedMoE))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: _checkpoint(arch, tmp_path_factory.mktemp(name)) for name, arch in RANK_MODELS.items()}


@pytest.fixture(scope="module")
def ep_ranks(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from helpers.tp_ranks import run_ranks

    args = [f"{name}={path}" for name, path in checkpoints.items()]
    return run_ranks(__file__, 2, tmp_path_factory.mktemp("ep2"), *args, timeout=240)


@pytest.mark.parametrize("name", list(RANK_MODELS))
def test_ep2_logits_equal_transformers_reference_and_kernel(
    checkpoints: dict[str, Path], ep_ranks: list[dict[str, Any]], name: str
) -> None:
    from test_models import hf_model
    from test_models_gpt_oss import max_logit_error

    reference = hf_model(checkpoints[name])
    for rank in ep_ranks:
        for run in ("reference", "kernel"):
            assert max_logit_error(SimpleNamespace(**rank[name][run]), reference) < 1e-4, (name, run)
    assert ep_ranks[0][name]["kernel_impls"] == ["cpu_moe"]  # the platform's kernel, on the local experts


@pytest.mark.parametrize("name", list(RANK_MODELS))
def test_ep2_rank_holds_only_its_half_of_the_experts(
    checkpoints: dict[str, Path], ep_ranks: list[dict[str, Any]], name: str
) -> None:
    whole = _load(RANK_MODELS[name], checkpoints[name])
    experts = _first_experts(whole)
    num_experts = experts.num_experts
    for ep_rank, rank in enumerate(ep_ranks):
        assert 2 * rank[name]["expert_bytes"] == _expert_bytes(whole)
        assert rank[name]["num_local_experts"] == num_experts // 2
        mine = slice(ep_rank * num_experts // 2, (ep_rank + 1) * num_experts // 2)
        assert torch.equal(rank[name]["w13"], experts.w13_weight[mine])
        if experts.w2_bias is not None:  # GPT-OSS: each rank adds its own experts' biases
            assert torch.equal(rank[name]["w2_bias"], experts.w2_bias[mine])
        # Per MoE layer per step: the counts, the rows and the results all-to-all, and one all-gather
        # (none for Qwen2-MoE, whose block's all-reduce gathers the shares).
        assert rank[name]["ep_collectives"] > 0


# ---- the engine -----------------------------------------------------------------------


@pytest.mark.slow
def test_engine_ep2_on_ray_greedy_matches_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_models import hf_model
    from test_models_engine_matrix import _hf_generate, _moe_checkpoint, _prompts

    from pagedllm import LLM

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = _moe_checkpoint("Qwen2MoeForCausalLM")
    first, _ = _prompts(hf_model(path).config.vocab_size)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              distributed_executor_backend="ray", enable_expert_parallel=True)
    try:
        outputs = _greedy(llm, first)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [_hf_generate(path, tuple(p)) for p in first]
        stats = llm.engine_core.engine_core.model_executor.collective_rpc("collective_stats")  # type: ignore[attr-defined]
        assert all(rank["ep_num_collectives"] > 0 for rank in stats)
    finally:
        llm.shutdown()


def _greedy(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from test_models_engine_matrix import NUM_NEW_TOKENS

    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# ---- the flag's checks ------------------------------------------------------------------


def _facts(hf_config: Any, impl: str = "native") -> Any:
    return SimpleNamespace(hf_config=hf_config, architecture="X", impl=lambda: SimpleNamespace(impl=impl))


def _parallel_config(tp: int) -> Any:
    from pagedllm.core.config import EngineConfig

    config = EngineConfig()
    config.parallel.tensor_parallel_size = tp
    config.parallel.enable_expert_parallel = True
    return config


def test_flag_with_experts_that_do_not_split_is_a_config_error_before_ranks_start() -> None:
    from pagedllm.worker.worker import check_expert_parallel

    with pytest.raises(ConfigError) as err:
        check_expert_parallel(_parallel_config(4), _facts(SimpleNamespace(num_local_experts=6)))
    assert (err.value.key, err.value.value) == (EP_FIELD, True)
    check_expert_parallel(_parallel_config(2), _facts(SimpleNamespace(num_experts=6)))  # 3 per rank: fine
    with pytest.raises(ConfigError, match="Transformers fallback"):
        check_expert_parallel(_parallel_config(2), _facts(SimpleNamespace(num_experts=8), impl="transformers"))


def test_flag_on_a_dense_model_or_one_rank_changes_nothing() -> None:
    """vLLM ignores the flag where there are no experts to place; so do we."""
    from pagedllm.worker.worker import check_expert_parallel

    check_expert_parallel(_parallel_config(2), _facts(SimpleNamespace(num_experts=0, intermediate_size=64)))
    check_expert_parallel(_parallel_config(1), _facts(SimpleNamespace(num_experts=7)))


def test_flag_spellings_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from pagedllm.core.config import FLAT_KEYS, EngineConfig
    from pagedllm.entrypoints.config_flags import add_engine_config_flags

    assert EngineConfig().parallel.enable_expert_parallel is False
    monkeypatch.setenv("PAGEDLLM_PARALLEL__ENABLE_EXPERT_PARALLEL", "1")
    assert EngineConfig().parallel.enable_expert_parallel is True
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_config_flags(parser)
    args = parser.parse_args(["--enable-expert-parallel"])
    assert args.engine_config__parallel__enable_expert_parallel is True
    assert FLAT_KEYS["enable_expert_parallel"] == ("parallel", "enable_expert_parallel")  # LLM(enable_expert_parallel=)


if __name__ == "__main__":  # one rank of the ep_ranks fixture
    from helpers.tp_ranks import init_rank_from_argv

    from pagedllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        get_ep_group,
        initialize_model_parallel,
    )
    from pagedllm.platforms.cpu import CpuPlatform
    from pagedllm.worker.layer_ops import prepare_layer_ops

    # init_rank_from_argv joins the TP group without expert parallelism: redo it with.
    ep_rank, world_size, out_dir, named_paths = init_rank_from_argv()
    destroy_model_parallel()
    initialize_model_parallel(world_size, enable_expert_parallel=True)
    ep_group = get_ep_group()
    assert ep_group is not None
    results: dict[str, Any] = {}
    for item in named_paths:
        name, path = item.split("=", 1)
        model = _load(RANK_MODELS[name], Path(path))
        experts = _first_experts(model)
        before = ep_group.num_collectives
        result: dict[str, Any] = {"reference": _run_batches(model)}
        result["ep_collectives"] = ep_group.num_collectives - before
        bound = prepare_layer_ops(model, CpuPlatform())
        result["kernel_impls"] = sorted(impl for impl in bound if impl == "cpu_moe")
        result["kernel"] = _run_batches(model)
        result["expert_bytes"] = _expert_bytes(model)
        result["num_local_experts"] = experts.num_local_experts
        result["w13"] = experts.w13_weight.detach().clone()
        if experts.w2_bias is not None:
            result["w2_bias"] = experts.w2_bias.detach().clone()
        results[name] = result
    torch.save(results, out_dir / f"rank{ep_rank}.pt")
    destroy_distributed_environment()
