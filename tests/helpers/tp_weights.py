"""One rank's weight bytes at a tensor-parallel size, from a Llama-family
config's shapes alone: the reference the TP tests check measured sizes
against (sharded matrices split, norms and replicated KV heads whole).

Mixture-of-experts layers (Qwen2/3-MoE, Mixtral, GPT-OSS): every rank
holds every expert, each with 1/tp of its intermediate rows (gate, up) and
columns (down); the router is replicated, and so are GPT-OSS's down-proj
biases (rank 0's hold the values, the others zeros)."""

from __future__ import annotations

import math
from typing import Any

GEMMA = ("gemma2", "gemma3_text")  # four norms per layer: around attention and around the MLP


def expected_param_bytes(hf_config: Any, tp_size: int, element_size: int = 4) -> int:
    """Bytes of one rank's parameters (`element_size` bytes each)."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    q_rows = heads // tp_size * head_dim
    kv_rows = max(kv_heads // tp_size, 1) * head_dim  # one replicated head when fewer heads than ranks
    qkv_bias = hf_config.model_type == "qwen2" or bool(
        getattr(hf_config, "qkv_bias", None) or getattr(hf_config, "attention_bias", False))
    attention = (
        (q_rows + 2 * kv_rows) * (hidden + qkv_bias)  # qkv_proj (+ bias)
        + hidden * q_rows  # o_proj: its input columns split
        + (4 if hf_config.model_type in GEMMA else 2) * hidden  # the RMSNorms, replicated
        + (2 * head_dim if hf_config.model_type in ("qwen3", "gemma3_text", "qwen3_moe") else 0)  # q_norm, k_norm
        + (q_rows + kv_rows if hf_config.model_type == "olmo2" else 0)  # q_norm, k_norm over this rank's heads
        + (heads // tp_size + hidden if hf_config.model_type == "gpt_oss" else 0)  # sinks; o_proj's bias, whole
    )
    mlp = sum(_mlp_elements(hf_config, layer, tp_size) for layer in range(hf_config.num_hidden_layers))
    vocab_rows = math.ceil(hf_config.vocab_size / tp_size)
    embeddings = vocab_rows * hidden * (1 if hf_config.tie_word_embeddings else 2)
    return element_size * (hf_config.num_hidden_layers * attention + mlp + embeddings + hidden)


def _is_sparse(hf_config: Any, layer: int) -> bool:
    """Whether `layer`'s MLP is routed experts (Qwen-MoE's rule; every layer of Mixtral and GPT-OSS)."""
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    return bool(num_experts) and layer not in (getattr(hf_config, "mlp_only_layers", None) or []) and (
        (layer + 1) % step == 0)


def _mlp_elements(hf_config: Any, layer: int, tp_size: int) -> int:
    hidden = hf_config.hidden_size
    if not _is_sparse(hf_config, layer):
        return 3 * (hf_config.intermediate_size // tp_size) * hidden  # gate_up_proj, down_proj
    num_experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    inter = (getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size) // tp_size
    elements = num_experts * 3 * inter * hidden + num_experts * hidden  # experts (w13, w2); the router
    if hf_config.model_type == "gpt_oss":  # the router's bias, w13's bias split, w2's whole
        elements += num_experts + num_experts * 2 * inter + num_experts * hidden
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)
    if shared:  # Qwen2-MoE's shared expert (split like a dense MLP) and its gate [1, hidden]
        elements += 3 * (shared // tp_size) * hidden + hidden
    return elements


def expected_weight_bytes(hf_config: Any, tp_size: int, element_size: int) -> int:
    """Parameters plus the rotary cos/sin buffers, replicated on every rank
    ([max_position_embeddings, head_dim / 2] each)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary = 2 * hf_config.max_position_embeddings * (head_dim // 2) * element_size
    return expected_param_bytes(hf_config, tp_size, element_size) + rotary
