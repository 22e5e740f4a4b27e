"""Rotary position embedding (Su et al., 2021), rotate-half (GPT-NeoX) layout.

The cos/sin table is computed once per model in float32 for every position;
a forward looks up its positions once and every layer applies the same rows.
The frequencies follow transformers' `modeling_rope_utils` (its
ROPE_INIT_FUNCTIONS) for each `rope_type`: default, linear, llama3, yarn,
longrope (legacy name: su) and dynamic (NTK). yarn and longrope also scale
cos and sin by an attention factor, as transformers does. A
`partial_rotary_factor` below 1 (Phi-4-mini: 0.75) rotates only the first
`rotary_dim` dims of each head; the rest pass through.

What a paged engine can do exactly. The KV cache keeps rotated keys, and a
block is shared by content (prefix caching), so a key must be rotated the
same way whatever request, chunk or step computes it: the table may depend
on the position and the model, never on a request's current length.

- longrope: transformers' `generate` uses the short factors while the whole
  sequence fits `original_max_position_embeddings` and the long ones once it
  is longer, and at the crossing drops its cache and re-encodes every earlier
  token with the long factors. No position-only rule can do both; picking
  per position (short below the original length, long past it) would mix two
  frequency sets in one sequence, so q.k would no longer depend on distance
  alone across the boundary. Like vLLM, the table is one set for the model:
  the long factors when the table reaches past
  `original_max_position_embeddings` (the checkpoint's max_position_embeddings
  does: a long-context model), else the short ones. Equal to transformers for
  every sequence that starts longer than the original length (prompt past
  it: transformers prefills and decodes with the long factors too), and, on
  a short-context model, for every sequence. Differs for a long-context model
  while a sequence is still within the original length (transformers: short
  factors there).
- dynamic: transformers recomputes the base from the sequence length
  (max(position) + 1) whenever it exceeds max_position_embeddings and keeps
  its cache, so during decode the token at position p is rotated with the
  base for length p + 1 and earlier keys keep theirs. The table does the
  same per position (row p: the base for max(p + 1, max_position_embeddings)),
  which equals transformers' generate whenever the prompt fits
  max_position_embeddings; a longer prompt is prefilled by transformers with
  one base for all its tokens (ours: per position). vLLM instead uses one
  base for max_position_embeddings * factor everywhere. The table reaches
  max_position_embeddings * factor positions (`rope_position_limit`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers.ops import ROTARY_EMBEDDING, OpLayer
from pagedllm.model_registry.layers.rope_parameters import get_rope_parameters as get_rope_parameters
from pagedllm.model_registry.layers.rope_parameters import required_rope_parameter as _required
from pagedllm.model_registry.layers.rope_parameters import rope_position_limit as rope_position_limit

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su", "dynamic")


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_parameters: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band
    # between interpolated smoothly.
    factor = _required(rope_parameters, "factor")
    low_freq_factor = _required(rope_parameters, "low_freq_factor")
    high_freq_factor = _required(rope_parameters, "high_freq_factor")
    old_context_len = _required(rope_parameters, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(rope_parameters: dict[str, Any], max_position: int | None) -> float:
    factor = rope_parameters.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
        original = _required(rope_parameters, "original_max_position_embeddings")
        if max_position is None:
            raise ConfigError("rope_parameters.factor", None, "a value (no max_position_embeddings to derive it)")
        factor = max_position / original
    return float(factor)


def _yarn_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any], max_position: int | None) -> torch.Tensor:
    """YaRN (Peng et al., 2023): interpolate the low frequencies by `factor`,
    keep the high ones, ramp linearly between the dims that turn beta_slow and
    beta_fast times over the original context."""
    base = rope_parameters["rope_theta"]
    factor = _yarn_factor(rope_parameters, max_position)
    original = _required(rope_parameters, "original_max_position_embeddings")
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _longrope_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any], long: bool) -> torch.Tensor:
    key = "long_factor" if long else "short_factor"
    ext_factors = torch.tensor(_required(rope_parameters, key), dtype=torch.float32)
    if ext_factors.shape != (rotary_dim // 2,):
        raise ConfigError(f"rope_parameters.{key}", len(ext_factors), f"{rotary_dim // 2} factors (rotary_dim / 2)")
    base = rope_parameters["rope_theta"]
    return 1.0 / (ext_factors * base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _dynamic_inv_freq(rotary_dim: int, rope_parameters: dict[str, Any], max_position: int, seq_lens: torch.Tensor
                      ) -> torch.Tensor:
    """[len(seq_lens), rotary_dim / 2]: dynamic NTK's frequencies for each
    sequence length (transformers' formula, in float32 as it computes it)."""
    factor = _required(rope_parameters, "factor")
    seq_lens = torch.clamp(seq_lens, min=max_position)
    base = rope_parameters["rope_theta"] * ((factor * seq_lens / max_position) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2)
    )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def compute_inv_freq(
    rotary_dim: int, rope_parameters: dict[str, Any], max_position: int | None = None, seq_len: int | None = None
) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS
    give them for a sequence of `seq_len` tokens (None: up to max_position).

    `max_position` is the config's max_position_embeddings: yarn and longrope
    derive a missing `factor` from it, dynamic NTK scales past it. longrope
    uses the long factors when `seq_len` exceeds original_max_position_embeddings.
    """
    base = rope_parameters["rope_theta"]
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        return _default_inv_freq(rotary_dim, base)
    if rope_type == "linear":
        return _default_inv_freq(rotary_dim, base) / _required(rope_parameters, "factor")
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(rotary_dim, base), rope_parameters)
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, rope_parameters, max_position)
    if rope_type in ("longrope", "su"):
        original = _required(rope_parameters, "original_max_position_embeddings")
        return _longrope_inv_freq(rotary_dim, rope_parameters, long=seq_len is not None and seq_len > original)
    if rope_type == "dynamic":
        if max_position is None or seq_len is None or seq_len <= max_position:
            return _default_inv_freq(rotary_dim, base)
        return _dynamic_inv_freq(rotary_dim, rope_parameters, max_position, torch.tensor([seq_len]))[0]
    raise ConfigError("rope_parameters.rope_type", rope_type, ", ".join(SUPPORTED_ROPE_TYPES))


def compute_attention_factor(rope_parameters: dict[str, Any], max_position: int | None = None) -> float:
    """What cos and sin are multiplied by: yarn's and longrope's attention
    factor (given, or from `factor` as the papers suggest), else 1."""
    rope_type = rope_parameters["rope_type"]
    if rope_type not in ("yarn", "longrope", "su"):
        return 1.0
    if rope_parameters.get("attention_factor") is not None:
        return float(rope_parameters["attention_factor"])
    if rope_type == "yarn":
        return _yarn_attention_factor(rope_parameters, _yarn_factor(rope_parameters, max_position))
    original = _required(rope_parameters, "original_max_position_embeddings")
    given_factor = rope_parameters.get("factor")
    # Phi-3 gives no factor: the ratio of the two lengths.
    factor = float(given_factor) if given_factor is not None else (max_position or original) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(rope_parameters: dict[str, Any], factor: float) -> float:
    """0.1 * ln(factor) + 1 (YaRN's mscale), or DeepSeek's ratio of two mscales."""

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
    return mscale_of(factor)


def rope_table(
    rotary_dim: int, max_position: int, rope_parameters: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_positions, rotary_dim / 2] in float32, the attention
    factor applied; rows for every position the model may see (the module
    docstring says which frequencies each row uses)."""
    rope_type = rope_parameters["rope_type"]
    if rope_type == "dynamic":
        num_positions = int(max_position * _required(rope_parameters, "factor"))
        positions = torch.arange(num_positions, dtype=torch.float32)
        inv_freq = compute_inv_freq(rotary_dim, rope_parameters, max_position)
        freqs = positions[:, None] * inv_freq[None, :]
        if num_positions > max_position:
            seq_lens = torch.arange(max_position + 1, num_positions + 1, dtype=torch.int64)
            scaled = _dynamic_inv_freq(rotary_dim, rope_parameters, max_position, seq_lens)
            freqs[max_position:] = positions[max_position:, None] * scaled
        return freqs.cos(), freqs.sin()
    # longrope: one factor set for the whole table (see the module docstring).
    inv_freq = compute_inv_freq(rotary_dim, rope_parameters, max_position, seq_len=max_position)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    attention_factor = compute_attention_factor(rope_parameters, max_position)
    if attention_factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def rotary_dim_of(head_size: int, rope_parameters: dict[str, Any]) -> int:
    """The dims of each head that rotate: head_size * partial_rotary_factor
    (transformers' int() of it)."""
    rotary_dim = int(head_size * rope_parameters.get("partial_rotary_factor", 1.0))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ConfigError(
            "rope_parameters.partial_rotary_factor",
            rope_parameters.get("partial_rotary_factor"),
            f"a fraction of head_size {head_size} giving an even rotary dim in (0, {head_size}]",
        )
    return rotary_dim


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # buffers, declared for the type checker
    sin_cache: torch.Tensor

    def __init__(self, head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        """`max_position`: the config's max_position_embeddings."""
        super().__init__()
        self.rotary_dim = rotary_dim_of(head_size, rope_parameters)
        cos, sin = rope_table(self.rotary_dim, max_position, rope_parameters)
        # [num_positions, rotary_dim / 2]; both halves of the rotated part share them.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, rotary_dim] for the batch's positions (< the table's length)."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin; x: [T, num_heads, head_size], cos/sin: [T, rotary_dim].

    Written half by half into x * cos, without rotate_half's negation and
    cat: a cat along a 32-wide last dim is slow on the CPU (2.4x less time in
    all for 2,500 tokens x 16 heads, one thread, bfloat16). Same result to the
    bit: x1 * c - x2 * s == x1 * c + (-x2) * s in IEEE arithmetic. With a
    rotary_dim below head_size (partial rotary) only the first rotary_dim
    dims of each head rotate; the rest are copied.

    The torch reference of `ApplyRotaryEmb`, which a platform's kernel may
    replace (ops.py).
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        out = x.clone()
        out[..., :rotary_dim] = apply_rotary_emb(x[..., :rotary_dim], cos, sin)
        return out
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
        # NOTE: kernels rotate whole heads; partial rotary takes the reference.
        if kernel is not None and cos.shape[-1] == x.shape[-1] and (fused := kernel(x, cos, sin)) is not None:
            return fused
        return apply_rotary_emb(x, cos, sin)
