"""benchmarks/roofline.py's FLOP count (what every throughput row's FLOP/s
is made of) against torch's own FLOP counter on the Hugging Face model: one
prefill forward of eager attention counts the linear layers, the LM head and
both attention matmuls exactly as the shape formula does."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from torch.utils.flop_counter import FlopCounterMode

_spec = importlib.util.spec_from_file_location(
    "roofline", Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py")
assert _spec is not None and _spec.loader is not None
roofline = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("roofline", roofline)  # dataclasses look their module up
_spec.loader.exec_module(roofline)


def test_the_shape_formula_counts_what_torch_counts_in_a_forward() -> None:
    from transformers import AutoModelForCausalLM

    model_dir = cached_tiny_model("llama", num_key_value_heads=2)
    shape = roofline.ModelShape.from_folder(model_dir)
    assert shape.num_kv_heads == 2 and shape.num_heads > shape.num_kv_heads  # GQA: k/v smaller than q
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    num_tokens = 13
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.arange(num_tokens).unsqueeze(0) + 5)
    # Eager attention multiplies the full square (the causal mask is applied after): n^2 keys.
    expected = 2 * shape.matmul_weights * num_tokens + shape.attention_flops(num_tokens * num_tokens)
    assert counter.get_total_flops() == expected


def test_generation_counts_each_fed_token_over_the_keys_it_sees() -> None:
    shape = roofline.ModelShape(hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=4, vocab_size=32)
    # q, k, v, o: 8*8 + 8*4 + 8*4 + 8*8 = 192; MLP 3*8*16 = 384; two layers and the LM head 8*32.
    assert shape.matmul_weights == 2 * (192 + 384) + 256
    # A 3-token prompt and 2 new tokens: 4 tokens fed, seeing 1, 2, 3 and 4 keys.
    assert roofline.generation_flops(shape, [3], 2) == 2 * shape.matmul_weights * 4 + shape.attention_flops(10)
    assert shape.attention_flops(10) == 4 * 2 * 2 * 4 * 10


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_a_moe_token_counts_its_router_top_k_and_shared_experts(architecture: str, tmp_path: Path) -> None:
    """The conformance kit's small MoE configs (Qwen3-MoE with a dense
    layer, Qwen2-MoE with a shared expert): what torch counts in transformers'
    forward, each token through its top-k experts only."""
    import transformers

    from pagedllm.testing.checkpoints import config_json

    config = config_json(architecture)
    assert config is not None
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = roofline.ModelShape.from_folder(tmp_path)
    assert shape.mlp_weights is not None
    hf_config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    # One F.linear per expert, and attention's matmuls over the full square: what the counter sees.
    hf_config._experts_implementation = hf_config._attn_implementation = "eager"
    model = getattr(transformers, architecture)(hf_config).to(torch.float32).eval()
    num_tokens = 13
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.arange(num_tokens).unsqueeze(0) + 5)
    expected = 2 * shape.matmul_weights * num_tokens + shape.attention_flops(num_tokens * num_tokens)
    assert counter.get_total_flops() == expected
