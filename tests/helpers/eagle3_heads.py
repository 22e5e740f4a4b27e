"""Tiny random EAGLE-3 heads in vLLM's checkpoint layout (LlamaForCausalLMEagle3),
written by the tests themselves with a fixed seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def eagle3_config(target_config: dict[str, Any], draft_vocab_size: int, aux_layer_ids: list[int]) -> dict[str, Any]:
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target_config["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads") or heads,
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": target_config["max_position_embeddings"],
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "rope_theta": target_config.get("rope_theta", 10000.0),
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids, "use_aux_hidden_state": True},
    }


def random_eagle3_weights(config: dict[str, Any], seed: int, with_embedding: bool = False) -> dict[str, torch.Tensor]:
    """vLLM's weight names; d2t maps the draft vocabulary onto a random
    subset of the target's (sorted, as SpecForge writes it)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    vocab, draft_vocab = config["vocab_size"], config["draft_vocab_size"]
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rand(hidden, scale=0.1)

    draft_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    weights = {
        "fc.weight": rand(hidden, num_aux * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(q_size, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_size, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_size, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q_size),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, hidden, scale=0.5),
        "d2t": draft_ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    if with_embedding:
        weights["embed_tokens.weight"] = rand(vocab, hidden, scale=1.0)
    return weights


def save_random_eagle3_head(
    target_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    **overrides: Any,
) -> Path:
    """A random-weight EAGLE-3 head for the target in `target_dir`."""
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    num_layers = target_config["num_hidden_layers"]
    if aux_layer_ids is None:
        aux_layer_ids = [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]
    config = eagle3_config(target_config, draft_vocab_size or target_config["vocab_size"] // 2, aux_layer_ids)
    config.update(overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_eagle3_weights(config, seed), str(out / "model.safetensors"))
    return out
