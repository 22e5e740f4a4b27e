"""DeepSeek-V2's multi-head latent attention (MLA; DeepSeek-AI, 2024), the
projections around the latent cache (layers/mla_attention.py).

    q      = q_proj(x)                      (q_lora_rank None)
           | q_b_proj(RMSNorm(q_a_proj(x)))  [T, H, qk_nope_head_dim + qk_rope_head_dim]
    c_kv, k_pe = kv_a_proj_with_mqa(x)      [T, kv_lora_rank], [T, qk_rope_head_dim]
    c_kv   = RMSNorm(c_kv)                  what the cache keeps, with RoPE(k_pe)
    k_h    = [W_UK_h c_kv, RoPE(k_pe)]      v_h = W_UV_h c_kv   (kv_b_proj = [W_UK_h; W_UV_h] per head)
    out    = o_proj(softmax(q_h . k_h * scale) v_h)

Decoupled RoPE: only the last qk_rope_head_dim dims of each query head and
the one shared k_pe rotate. DeepSeek's checkpoints rotate interleaved pairs
(x0, x1), (x2, x3), ... (transformers' V2 rotates them as complex numbers,
V3 with `rope_interleave` de-interleaves first); both give the same q . k,
which is all attention reads, so the pairs are gathered to halves
([x0, x2, ..., x1, x3, ...]) and the rotate-half rotary applies.
`rope_interleave: false` (V3) keeps rotate-half as it is.

Scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when
the config's YaRN `rope_scaling` has `mscale_all_dim` (transformers'
`yarn_apply_mscale`); YaRN's own attention factor scales cos/sin (rotary.py).

Tensor parallel: q (or q_b) and kv_b split by heads, o_proj by rows (one
all-reduce); q_a and kv_a replicated, so every rank caches the same latents.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.model_registry.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model_registry.layers.mla_attention import MLAAttention
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.rotary import ApplyRotaryEmb, get_rope_parameters
from pagedllm.model_registry.layers.tp_heads import divide

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata

# transformers' DeepseekV2RMSNorm default: the q_a and kv_a norms do not take rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(hf_config: Any) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(all dims) squared."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    rope_parameters = get_rope_parameters(hf_config)
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    factor = rope_parameters.get("factor") or 1.0
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend]) -> None:
        super().__init__()
        hidden_size, total_num_heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.qk_nope_head_dim = hf_config.qk_nope_head_dim
        self.qk_rope_head_dim = hf_config.qk_rope_head_dim
        self.v_head_dim = hf_config.v_head_dim
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # The rotary table's width (LlamaModel builds one table for all layers).
        self.head_dim = self.qk_rope_head_dim
        self.interleaved = bool(getattr(hf_config, "rope_interleave", True))
        bias = bool(getattr(hf_config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, total_num_heads * self.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_num_heads * self.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        # Read by the attention impl as weights (absorbed), never called.
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              total_num_heads * (self.qk_nope_head_dim + self.v_head_dim))
        self.kv_b_proj.skip_quantization = True  # left in float by quantization (worker/quantize.py)
        self.o_proj = RowParallelLinear(total_num_heads * self.v_head_dim, hidden_size, bias=bias)
        self.num_heads = divide(total_num_heads, self.o_proj.tp_size, "attention heads")
        self.rotary = ApplyRotaryEmb()
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, mla_softmax_scale(hf_config), attn_backend)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        num_tokens = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        k_pe = k_pe.unsqueeze(1)  # [T, 1, R]: one "head"
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = self.rotary(q_pe.contiguous(), cos, sin)
        k_pe = self.rotary(k_pe.contiguous(), cos, sin)[:, 0]
        kv_b_weight = self.kv_b_proj.weight
        if not kv_b_weight.is_floating_point():
            raise RuntimeError("kv_b_proj must stay in floating point (latent attention reads it as weights; "
                               "it declares skip_quantization)")
        out = self.attn(q_nope, q_pe, kv_c, k_pe, kv_b_weight, attn_metadata)
        return self.o_proj(out)
