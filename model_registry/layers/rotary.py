"""Rotary position embedding (Su et al., 2021), rotate-half (GPT-NeoX) layout.

The cos/sin table is computed once per model in float32 for every position;
a forward looks up its positions once and every layer applies the same rows.
Supports the default RoPE and Llama 3.1's frequency scaling ("llama3").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.ops import ROTARY_EMBEDDING, OpLayer

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """rope_theta and scaling from either config layout.

    transformers 5 keeps them in ``rope_parameters`` ({rope_type, rope_theta,
    ...}); older configs use ``rope_theta`` plus an optional ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    base = rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"]
    if rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band
        # between interpolated smoothly.
        factor = rope_parameters["factor"]
        low_freq_factor = rope_parameters["low_freq_factor"]
        high_freq_factor = rope_parameters["high_freq_factor"]
        old_context_len = rope_parameters["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ConfigError("rope_parameters.rope_type", rope_type, ", ".join(SUPPORTED_ROPE_TYPES))


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # buffers, declared for the type checker
    sin_cache: torch.Tensor

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_size, rope_parameters)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_position, head_size / 2]; both halves of a head share them.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, head_size] for the batch's positions (< max_position)."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x: [T, num_heads, head_size], cos/sin: [T, head_size].

    Written half by half into x * cos, without rotate_half's negation and
    cat: a cat along a 32-wide last dim is slow on the CPU (2.4x less time in
    all for 2,500 tokens x 16 heads, one thread, bfloat16). Same result to the
    bit: x1 * c - x2 * s == x1 * c + (-x2) * s in IEEE arithmetic.

    The torch reference of `ApplyRotaryEmb`, which a platform's kernel may
    replace (ops.py).
    """
    half = x.shape[-1] // 2
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


class ApplyRotaryEmb(nn.Module, OpLayer):
    """`apply_rotary_emb` as an op layer: a platform's kernel (ops.py) may
    rotate x in place instead. No weights."""

    op_name = ROTARY_EMBEDDING

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kernel = self.op_kernel
        if kernel is not None and (fused := kernel(x, cos, sin)) is not None:
            return fused
        return apply_rotary_emb(x, cos, sin)
