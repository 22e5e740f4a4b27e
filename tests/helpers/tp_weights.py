"""One rank's weight bytes at a tensor-parallel size, from a Llama-family
config's shapes alone: the reference the TP tests check measured sizes
against (sharded matrices split, norms and replicated KV heads whole)."""

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
    intermediate = hf_config.intermediate_size // tp_size
    qkv_bias = hf_config.model_type == "qwen2" or getattr(hf_config, "attention_bias", False)
    layer = (
        (q_rows + 2 * kv_rows) * (hidden + qkv_bias)  # qkv_proj (+ bias)
        + hidden * q_rows  # o_proj: its input columns split
        + 2 * intermediate * hidden + hidden * intermediate  # gate_up_proj, down_proj
        + (4 if hf_config.model_type in GEMMA else 2) * hidden  # the RMSNorms, replicated
        + (2 * head_dim if hf_config.model_type in ("qwen3", "gemma3_text") else 0)  # q_norm, k_norm
        + (q_rows + kv_rows if hf_config.model_type == "olmo2" else 0)  # q_norm, k_norm over this rank's heads
    )
    vocab_rows = math.ceil(hf_config.vocab_size / tp_size)
    embeddings = vocab_rows * hidden * (1 if hf_config.tie_word_embeddings else 2)
    return element_size * (hf_config.num_hidden_layers * layer + embeddings + hidden)


def expected_weight_bytes(hf_config: Any, tp_size: int, element_size: int) -> int:
    """Parameters plus the rotary cos/sin buffers, replicated on every rank
    ([max_position_embeddings, head_dim / 2] each)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary = 2 * hf_config.max_position_embeddings * (head_dim // 2) * element_size
    return expected_param_bytes(hf_config, tp_size, element_size) + rotary
