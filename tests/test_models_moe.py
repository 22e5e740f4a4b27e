"""Qwen3-MoE, Qwen2-MoE and Mixtral against transformers (float32).

Each checkpoint is built here from transformers' config class (8 experts,
top-2, hidden 64) with the router's and the experts' weights scaled so that
the routing varies from token to token and each token's top-2 is decisive
(no near-tie that rounding could flip); Qwen3-MoE has one dense layer
(`mlp_only_layers`) between two sparse ones, Qwen2-MoE's shared expert and
its sigmoid gate act, and Mixtral's window is shorter than the long prompts.
`test_each_mechanism_matters` switches one off in our model alone and checks
the logits then differ. The engine at -tp 1 and 2 with chunks, preemption
and drafts: test_models_engine_matrix.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import PagedBatchRunner, hf_model, run_mixed_schedule, save_with_tokenizer
from test_models_gpt_oss import max_logit_error

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.mixtral import MixtralForCausalLM
from pagedllm.model_registry.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.model_registry.models.qwen3_moe import Qwen3MoeForCausalLM

NUM_EXPERTS, TOP_K = 8, 2
MIXTRAL_WINDOW = 12
MODEL_CLASSES: dict[str, type[Any]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def _config(architecture: str, vocab_size: int, window: int, **special_tokens: Any) -> Any:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, num_experts_per_tok=TOP_K, **special_tokens)
    if architecture == "Qwen3MoeForCausalLM":  # sparse, dense, sparse
        return Qwen3MoeConfig(**common, num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=96,
                              moe_intermediate_size=32, num_experts=NUM_EXPERTS, norm_topk_prob=True)
    if architecture == "Qwen2MoeForCausalLM":
        return Qwen2MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_experts=NUM_EXPERTS, norm_topk_prob=False)
    return MixtralConfig(**common, num_hidden_layers=2, intermediate_size=32, num_local_experts=NUM_EXPERTS,
                         sliding_window=window)


def build_moe(architecture: str, path: Path, seed: int = 0, window: int = MIXTRAL_WINDOW) -> Path:
    """A random `architecture` checkpoint of transformers' class, float32
    safetensors, with the shipped tokenizer (Mixtral's sliding `window`)."""
    import transformers
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer_dir = Path(get_tokenizer_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = _config(architecture, len(tokenizer), window, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "moe.gate.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 0.5)  # router logits of a few units: a clear, varying top-2
            elif ".experts." in name:
                param.normal_(0.0, 0.2)  # experts whose outputs differ visibly
            else:
                param.add_(torch.randn_like(param) * 0.02)  # norms away from 1, biases away from 0
    return save_with_tokenizer(model, path)


_checkpoints: dict[str, Path] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    for architecture in MODEL_CLASSES:
        if architecture not in _checkpoints:
            _checkpoints[architecture] = build_moe(architecture, tmp_path_factory.mktemp(architecture) / "model")
    return _checkpoints


def run_paged_batches(architecture: str, checkpoint: Path) -> PagedBatchRunner:
    return run_mixed_schedule(load_model(checkpoint, model_cls=MODEL_CLASSES[architecture],
                                         attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu"),
                              first_id=8)


@pytest.mark.parametrize("architecture", list(MODEL_CLASSES))
def test_paged_batches_match_hf_logits_and_greedy_tokens(checkpoints: dict[str, Path], architecture: str) -> None:
    path = checkpoints[architecture]
    reference = hf_model(path)
    runner = run_paged_batches(architecture, path)
    assert max_logit_error(runner, reference) < 1e-4
    for r, tokens in enumerate(runner.tokens):
        prompt_len = runner.prompt_lens[r]
        with torch.no_grad():
            expected = reference(torch.tensor([tokens[:-1]])).logits[0]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("architecture", list(MODEL_CLASSES))
def test_routing_varies_and_each_top_k_is_decisive(checkpoints: dict[str, Path], architecture: str) -> None:
    """Over the batches above, every sparse layer sends tokens to most of
    its experts, and no token's k-th and (k+1)-th router logits are near a
    tie (float32 rounds logits of a few units at ~1e-6); Qwen3-MoE's dense
    layer has no experts."""
    model = load_model(checkpoints[architecture], model_cls=MODEL_CLASSES[architecture],
                       attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    gaps: list[torch.Tensor] = []

    def record_gap(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        router_logits = args[1]  # FusedMoE.forward(x, router_logits)
        top = router_logits.float().topk(TOP_K + 1, dim=-1).values
        gaps.append(top[:, TOP_K - 1] - top[:, TOP_K])

    for layer in experts:
        layer.register_forward_hook(record_gap)
    gen = torch.Generator().manual_seed(1)
    runner = PagedBatchRunner(model)
    for length in (5, 13, 21):
        runner.add_request(torch.randint(8, model.config.vocab_size, (length,), generator=gen).tolist())
    runner.step([(0, 5), (1, 13), (2, 21)])
    for _ in range(3):
        runner.step([(0, 1), (1, 1), (2, 1)])
    assert len(experts) == model.config.num_hidden_layers - (architecture == "Qwen3MoeForCausalLM")
    for layer in experts:
        counts = layer.take_expert_counts()
        assert counts.sum() == TOP_K * (5 + 13 + 21 + 3 * 3)
        assert int((counts > 0).sum()) >= NUM_EXPERTS // 2, counts.tolist()
    assert float(torch.cat(gaps).min()) > 1e-3


def _without_shared_expert(model: Any) -> None:
    for layer in model.model.layers:
        layer.mlp.shared_expert_gate.weight.data.fill_(-1e4)  # sigmoid -> 0


def _flip_renormalize(model: Any) -> None:
    import dataclasses

    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.router = dataclasses.replace(module.router, renormalize=not module.router.renormalize)


def _without_window(model: Any) -> None:
    for attn in model.get_attention_layers():
        attn.impl.sliding_window = None


@pytest.mark.parametrize(
    ("architecture", "switch_off"),
    [("Qwen2MoeForCausalLM", _without_shared_expert), ("Qwen2MoeForCausalLM", _flip_renormalize),
     ("Qwen3MoeForCausalLM", _flip_renormalize), ("MixtralForCausalLM", _without_window)],
    ids=["qwen2-moe-shared-expert", "qwen2-moe-norm-topk-prob", "qwen3-moe-norm-topk-prob", "mixtral-window"],
)
def test_each_mechanism_matters(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                architecture: str, switch_off: Any) -> None:
    """Guards the equality test against a mechanism the tiny models never
    exercise: with it switched off in our model only, the logits are off."""
    model_cls = MODEL_CLASSES[architecture]
    original_load = model_cls.load_weights

    def load_then_switch_off(self: Any, weights: Any) -> set[str]:
        loaded = original_load(self, weights)
        switch_off(self)
        return loaded

    monkeypatch.setattr(model_cls, "load_weights", load_then_switch_off)
    assert max_logit_error(run_paged_batches(architecture, checkpoints[architecture]),
                           hf_model(checkpoints[architecture])) > 1e-2


@pytest.mark.parametrize("architecture", list(MODEL_CLASSES))
def test_env_names_the_native_model_and_its_window(checkpoints: dict[str, Path], architecture: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`pagedllm env --model PATH` resolves each MoE architecture to its
    native class and reads Mixtral's window (none for the Qwen-MoE ones)."""
    import json

    from pagedllm.entrypoints.cli import main

    assert main(["env", "--json", "--platform", "cpu", "--model", str(checkpoints[architecture])]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["architecture"], payload["model_impl"]) == (architecture, "native")
    assert payload["head_sizes"] == [16]
    assert payload["sliding_window"] == (MIXTRAL_WINDOW if architecture == "MixtralForCausalLM" else None)
