"""The throughput benchmark's model: a Llama with random weights from a fixed
seed (hidden 256, intermediate 688, 4 layers, 4 heads, 2 KV heads), paired
with the project's BPE tokenizer. Random weights on purpose: its shape is what
the benchmark's figures are quoted for, and it never needs training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pagedllm.model_registry.tiny.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    VOCAB_SIZE,
    special_token_ids,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SEED = 0
INIT_STD = 0.02  # HF's initializer_range


# The ~100M Llama the scale-out and bf16 figures are quoted for (88M
# parameters: hidden 768, 12 layers, GQA 12/4; issue 17's workload).
LLAMA_100M = {
    "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
}  # fmt: skip


def benchmark_llama_config(token_ids: dict[str, int], sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """The benchmark Llama's config.json; `sizes` replaces its shape (LLAMA_100M)."""
    hidden_size, num_heads = 256, 4
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 2,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": token_ids[EOS_TOKEN],
        "pad_token_id": token_ids[PAD_TOKEN],
        "torch_dtype": "float32",
        "use_cache": True,
    } | (sizes or {})


def random_llama_weights(config: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """HF-named float32 tensors initialised like HF's `_init_weights`:
    normal(0, 0.02) for linear and embedding weights, ones for RMSNorm, the
    padding row of the embedding zeroed. A private generator keeps it
    independent of the global RNG state."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=generator)

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    weights: dict[str, torch.Tensor] = {}
    embed = normal(vocab, hidden)
    if config.get("pad_token_id") is not None:
        embed[config["pad_token_id"]] = 0.0
    weights["model.embed_tokens.weight"] = embed
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.self_attn.q_proj.weight"] = normal(q_size, hidden)
        weights[f"{prefix}.self_attn.k_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.v_proj.weight"] = normal(kv_size, hidden)
        weights[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_size)
        weights[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden)
        weights[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter)
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def build_benchmark_model(out_dir: Path, tokenizer_dir: Path, sizes: dict[str, int] | None = None) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    token_ids = special_token_ids(tokenizer_dir)
    config = benchmark_llama_config(token_ids, sizes)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    save_file(random_llama_weights(config), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
