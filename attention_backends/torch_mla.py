"""Latent attention (MLA) in PyTorch: the `cpu` backend's impl for DeepSeek's
latent layers, on the CPU and as CUDA's last resort.

The CPU's C kernels (cpu_decode_kernel.py, cpu_prefill_kernel.py) attend
per-head K and V of one head size; a latent layer has neither, so this runs
in torch over the backend's batch plan (torch_native_plan.py: the same request
groups, key slots and masks), and refuses graph capture: its steps run
eagerly.

- Decodes and prefill chunks over cached context: absorbed. The query
  moves into latent space (q_nope_h W_UK_h), each group's cached latents are
  gathered once ([B, S, L + R], no head dimension) and one SDPA call scores
  them for every head against [q_lat, q_pe] (the latent is both the key's
  first L dims and the value); W_UV then maps the weighted latent into each
  head's value space.
- Fresh prefills (no cached context): expanded. Each head's keys and values
  are computed from this step's latents (k = [W_UK c, k_pe], v = W_UV c) and
  one causal SDPA per request attends them: a prompt of P tokens costs
  P x (Dn + Dv) per head once, where absorption would score every pair in
  L + R dims.

The two forms are one function of the same weights (tests check them
against each other and against transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.attention_backends.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv, read_kv, write_kv
from pagedllm.attention_backends.mla import MLAAttentionImpl, absorb_query, unabsorb_output
from pagedllm.attention_backends.torch_native_plan import TorchNativeMetadata, build_batch_plan
from pagedllm.platforms.cpu.graph import refuse_capture

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionMetadata
    from pagedllm.attention_backends.torch_native_plan import RequestGroup


class TorchMLAImpl(MLAAttentionImpl):
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
        refuse_capture("latent attention runs in torch with host-side indices")
        plan = attn_metadata.plan if isinstance(attn_metadata, TorchNativeMetadata) else None
        if plan is None:
            plan = build_batch_plan(attn_metadata, kv_cache.shape[2])
        num_tokens = plan.num_actual_tokens
        q_nope, q_pe, kv_c_normed, k_pe = q_nope[:num_tokens], q_pe[:num_tokens], kv_c_normed[:num_tokens], \
            k_pe[:num_tokens]
        # [1, num_blocks, block_size, 1, L + R] -> flat slots [num_slots, L + R]
        latent_cache = kv_cache[0].view(-1, kv_cache.shape[-1])
        latent = torch.cat([kv_c_normed, k_pe], dim=-1)  # [T, L + R]
        if plan.write_rows is None:
            write_kv(latent_cache, plan.write_slots, latent, self.kv_scale)
        else:
            write_kv(latent_cache, plan.write_slots, latent[plan.write_rows], self.kv_scale)
        w_uk, w_uv = self.split_kv_b(kv_b_weight.to(q_nope.dtype))
        output = q_nope.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        if plan.fresh_prefill_rows:
            if is_fp8(latent_cache.dtype):  # attend over what the cache holds, as every other row does
                latent = dequantize_kv(quantize_kv(latent, latent_cache.dtype, self.kv_scale), latent.dtype,
                                       self.kv_scale)
            for start, end in plan.fresh_prefill_rows:
                output[start:end] = self.expanded_prefill(q_nope[start:end], q_pe[start:end], latent[start:end],
                                                          w_uk, w_uv)
        for group in plan.gather_groups:
            rows = group.token_rows
            if rows is None:
                output[:] = self.absorbed(q_nope, q_pe, latent_cache, group, w_uk, w_uv)
            else:
                output.index_copy_(0, rows, self.absorbed(q_nope[rows], q_pe[rows], latent_cache, group, w_uk, w_uv))
        return output

    def absorbed(
        self,
        q_nope: torch.Tensor,  # [Tg, H, Dn]
        q_pe: torch.Tensor,  # [Tg, H, R]
        latent_cache: torch.Tensor,  # [num_slots, L + R]
        group: RequestGroup,
        w_uk: torch.Tensor,  # [H, Dn, L]
        w_uv: torch.Tensor,  # [H, Dv, L]
    ) -> torch.Tensor:  # [Tg, H, Dv]
        """Attention in latent space over each request's cached latents."""
        num_reqs, max_query_len, num_heads = group.num_reqs, group.max_query_len, self.num_heads
        query = torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)  # [Tg, H, L + R]
        if group.padded_rows is not None:
            padded = query.new_zeros(num_reqs * max_query_len, num_heads, query.shape[-1])
            padded.index_copy_(0, group.padded_rows, query)
            query = padded
        q = query.view(num_reqs, max_query_len, num_heads, -1).transpose(1, 2)  # [B, H, max_q, L + R]
        keys = read_kv(latent_cache, group.flat_key_slots, q.dtype, self.kv_scale)
        keys = keys.view(num_reqs, 1, group.max_seq_len, -1)  # [B, 1, S, L + R]: one "head" for all
        values = keys[..., : self.kv_lora_rank]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask(None), scale=self.scale,
                                             enable_gqa=num_heads > 1)  # [B, H, max_q, L]
        out = out.transpose(1, 2).reshape(num_reqs * max_query_len, num_heads, self.kv_lora_rank)
        if group.padded_rows is not None:
            out = out.index_select(0, group.padded_rows)
        return unabsorb_output(out, w_uv)

    def expanded_prefill(
        self,
        q_nope: torch.Tensor,  # [P, H, Dn], one request's whole prompt so far
        q_pe: torch.Tensor,  # [P, H, R]
        latent: torch.Tensor,  # [P, L + R]
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:  # [P, H, Dv]
        """Causal attention over keys and values expanded per head."""
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = torch.einsum("pl,hdl->phd", kv_c, w_uk)
        values = torch.einsum("pl,hvl->phv", kv_c, w_uv)
        keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys, values))  # [1, H, P, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out[0].transpose(0, 1)
