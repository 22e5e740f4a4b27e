"""Latent attention (MLA) on the Triton backend: the torch MLA impl's
interface, with the cache write and the absorbed attention in Triton
(attention_backends/triton/latent_attention.py).

- Every row that attends over cached latents (decodes, speculative verify
  steps, prefill chunks over cached context): absorbed, in one Triton launch.
  The query moves into latent space (torch einsum, q_nope_h W_UK_h), the
  kernel returns the softmax-weighted latent per head and W_UV maps it into
  each head's value space (torch einsum). Everything reads device tensors
  only, so these steps can be captured in a CUDA graph.
- Fresh prefills (query length == sequence length > 1): expanded, as the
  torch impl does them (`TorchMLAImpl.expanded_prefill`, per-head K/V from
  the step's latents and one causal SDPA per request), and the kernel skips
  their rows: absorbed, a prompt would score every pair in L + R dims. They
  are found on the host (`query_start_loc_cpu`, `seq_lens_cpu`), so never
  while a graph is being captured (a captured step holds no fresh prefill;
  should one, the kernel's absorbed form is still exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.attention_backends.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv
from pagedllm.attention_backends.mla import absorb_query, unabsorb_output
from pagedllm.attention_backends.torch_mla import TorchMLAImpl
from pagedllm.attention_backends.triton.latent_attention import latent_attention, write_latent_cache
from pagedllm.platforms.cpu.graph import capturing_any_graph

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionMetadata


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fresh_prefill_rows(attn_metadata: AttentionMetadata) -> list[tuple[int, int]]:
    """(start, end) query rows of each request with no cached context and more than one token."""
    num_reqs = attn_metadata.num_reqs
    query_start_loc = attn_metadata.query_start_loc_cpu[: num_reqs + 1]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    fresh = ((query_lens > 1) & (query_lens == attn_metadata.seq_lens_cpu[:num_reqs])).nonzero().squeeze(1)
    return list(zip(query_start_loc[fresh].tolist(), query_start_loc[fresh + 1].tolist(), strict=True))


class TritonMLAImpl(TorchMLAImpl):
    """Reuses `TorchMLAImpl.expanded_prefill` for fresh prefills; see the module docstring."""

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = attn_metadata.num_actual_tokens
        kv_c, k_pe = _last_dim_contiguous(kv_c_normed[:num_tokens]), _last_dim_contiguous(k_pe[:num_tokens])
        # NOTE: an fp8 cache's values are converted by torch, as the triton
        # backend's per-head impl does: the same bits as the torch impl's.
        write_latent_cache(quantize_kv(kv_c, kv_cache.dtype, self.kv_scale),
                           quantize_kv(k_pe, kv_cache.dtype, self.kv_scale), kv_cache, attn_metadata.slot_mapping)
        w_uk, w_uv = self.split_kv_b(kv_b_weight.to(q_nope.dtype))
        fresh = [] if capturing_any_graph() else fresh_prefill_rows(attn_metadata)
        q_lat = _last_dim_contiguous(absorb_query(q_nope[:num_tokens], w_uk))  # [T, H, L]
        latent_out = torch.empty_like(q_lat)
        latent_attention(latent_out, q_lat, _last_dim_contiguous(q_pe[:num_tokens]), kv_cache,
                         attn_metadata.block_table, attn_metadata.seq_lens, attn_metadata.query_start_loc,
                         num_reqs=attn_metadata.num_reqs, scale=self.scale, kv_scale=self.kv_scale,
                         skip_fresh_prefills=bool(fresh))
        # Rows past num_actual_tokens (padding of a captured batch) stay zero.
        output = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_head_dim)
        output[:num_tokens] = unabsorb_output(latent_out, w_uv)
        if fresh:
            latent = torch.cat([kv_c, k_pe], dim=-1)
            if is_fp8(kv_cache.dtype):  # attend over what the cache holds, as every other row does
                latent = dequantize_kv(quantize_kv(latent, kv_cache.dtype, self.kv_scale), latent.dtype,
                                       self.kv_scale)
            for start, end in fresh:
                output[start:end] = self.expanded_prefill(q_nope[start:end], q_pe[start:end], latent[start:end],
                                                          w_uk, w_uv)
        return output
