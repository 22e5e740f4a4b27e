"""DeepSeek-V2 and DeepSeek-V3 (latent attention, MoE) against transformers
in float32, and the latent attention's absorbed form against its expanded one.

The checkpoints are built here from transformers' config classes: V2 with
q_lora_rank None (q_proj), group-limited greedy routing (the best of 2 groups),
YaRN with mscale_all_dim 0.707 (the softmax scale moves); V3 with
q_lora_rank set, 1 dense first layer, sigmoid routing with a random
e_score_correction_bias and noaux_tc groups, YaRN. Routers' and experts'
weights are scaled so that the routing varies from token to token. The
engine at -tp 1 and 2 with chunks, preemption and drafts:
test_models_engine_matrix.py; the latent KV cache's size and a connector
round trip: test_kv_cache_mla.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import hf_model, run_mixed_schedule, save_with_tokenizer
from test_models_gpt_oss import max_logit_error

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.mla_attention import MLAAttention
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MODEL_CLASSES: dict[str, type[Any]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
NUM_EXPERTS, TOP_K = 8, 2


def deepseek_config(architecture: str, vocab_size: int, **special_tokens: Any) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=96, moe_intermediate_size=32, n_routed_experts=NUM_EXPERTS,
                  num_experts_per_tok=TOP_K, n_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=24, max_position_embeddings=256, **special_tokens)
    if architecture == "DeepseekV2ForCausalLM":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}
        # Top-2 within the best of 2 groups, by each group's best expert (2
        # of 4 groups eligible would hold any top-2 already: no effect).
        return DeepseekV2Config(**common, num_hidden_layers=2, q_lora_rank=None, topk_method="group_limited_greedy",
                                n_group=2, topk_group=1,
                                routed_scaling_factor=1.5, first_k_dense_replace=0, rope_parameters=rope)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 128,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    return DeepseekV3Config(**common, num_hidden_layers=3, q_lora_rank=24, routed_scaling_factor=2.5, n_group=4,
                            topk_group=2,
                            first_k_dense_replace=1, norm_topk_prob=True, rope_parameters=rope)


def build_deepseek(architecture: str, path: Path, seed: int = 0) -> Path:
    """A random `architecture` checkpoint of transformers' class, float32
    safetensors, with the shipped tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer_dir = Path(get_tokenizer_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = deepseek_config(architecture, len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)  # router logits of a few units: a clear, varying top-k
            elif ".experts." in name:
                param.normal_(0.0, 0.2)  # experts whose outputs differ visibly
            else:
                param.add_(torch.randn_like(param) * 0.02)  # norms away from 1
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)  # moves some choices, not the weights
    return save_with_tokenizer(model, path)


_checkpoints: dict[str, Path] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    for architecture in ARCHITECTURES:
        if architecture not in _checkpoints:
            _checkpoints[architecture] = build_deepseek(architecture, tmp_path_factory.mktemp(architecture) / "m")
    return _checkpoints


def _load(architecture: str, path: Path) -> Any:
    return load_model(path, model_cls=MODEL_CLASSES[architecture], attn_backend=TorchNativeBackend,
                      dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_paged_batches_match_hf_logits_and_greedy_tokens(checkpoints: dict[str, Path], architecture: str) -> None:
    path = checkpoints[architecture]
    reference = hf_model(path)
    model = _load(architecture, path)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    runner = run_mixed_schedule(model, first_id=8)
    assert max_logit_error(runner, reference) < 1e-4
    for r, tokens in enumerate(runner.tokens):
        prompt_len = runner.prompt_lens[r]
        with torch.no_grad():
            expected = reference(torch.tensor([tokens[:-1]])).logits[0]
        assert tokens[prompt_len:] == expected[prompt_len - 1 :].argmax(-1).tolist()
    # Routing varies token to token: every sparse layer used most of its experts.
    assert len(experts) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    for layer in experts:
        assert int((layer.take_expert_counts() > 0).sum()) >= NUM_EXPERTS // 2


def _switch_off(model: Any, what: str) -> None:
    import dataclasses

    for module in model.modules():
        if what == "scale" and isinstance(module, MLAAttention):
            impl = module.mla_impl
            impl.scale = (impl.qk_nope_head_dim + impl.qk_rope_head_dim) ** -0.5
        if what == "bias" and hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data.zero_()
        if what == "groups" and isinstance(module, FusedMoE):
            module.router = dataclasses.replace(module.router, num_expert_group=None, topk_group=None)
        if what == "interleave" and hasattr(module, "interleaved"):
            module.interleaved = False


@pytest.mark.parametrize(("architecture", "what"), [
    ("DeepseekV2ForCausalLM", "scale"), ("DeepseekV2ForCausalLM", "groups"), ("DeepseekV2ForCausalLM", "interleave"),
    ("DeepseekV3ForCausalLM", "bias"), ("DeepseekV3ForCausalLM", "groups"),
])
def test_each_mechanism_matters(checkpoints: dict[str, Path], architecture: str, what: str) -> None:
    """Guards the equality test: with one mechanism switched off in our
    model only (YaRN's mscale in the softmax scale, the expert groups, the
    interleaved RoPE pairs, V3's correction bias), the logits are off."""
    model = _load(architecture, checkpoints[architecture])
    _switch_off(model, what)
    runner = run_mixed_schedule(model, first_id=8)
    assert max_logit_error(runner, hf_model(checkpoints[architecture])) > 1e-3
