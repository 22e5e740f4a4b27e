"""The `cpu` attention backend (registered as `cpu`; `torch_native`, its name
before it ran C kernels, still selects it): paged attention in PyTorch, with
the CPU's C kernels for decode and fresh prefills where they take the batch
(cpu_decode_kernel.py, cpu_prefill_kernel.py); plain torch elsewhere, which
makes it CUDA's last resort too.

The batch is flattened (prefill chunks with cached context and decodes mixed,
no padding). Every layer sees the same batch, so everything that depends only
on the batch — which token goes to which padded query row, which cache slots
hold each request's keys, the causal mask — is computed once per forward in a
`TorchNativeBatchPlan` (by `TorchNativeBackend.build_metadata`, which the
model runner calls) and reused by all layers. Per layer, the work is: write
the new K/V into the cache, gather K/V of each request group through the
block table into a padded tensor, and one `scaled_dot_product_attention` call
per group.

Requests are split into padded groups, decodes (query_len == 1) and prefill
chunks with cached context, so that one long prefill does not pad every
decode to its query length; decodes of very different context lengths are
split once more (`split_by_length`), so that short contexts are not padded to
the longest one: the gather and the decode SDPA read every padded key
(contexts spread evenly stay one group). A fresh prefill (no cached context: its
keys are exactly this step's keys) skips the cache and the padding: one
causal SDPA call per request over its own rows, which lets the kernel skip
the masked half. For 16 prompts of 64-256 tokens that is 2.2x less attention
time than one padded, masked call (bfloat16 and float32, one thread). On the
CPU (no soft cap, no window shorter than the prompt, an unquantized cache),
the C kernel of cpu_prefill_kernel.py does all the fresh prefills of the
layer in one call instead, writing into the output rows.

On the CPU, the decodes over a float32 or bfloat16 cache skip the gather
and SDPA: the C kernel of cpu_decode_kernel.py reads each request's keys and
values in place through its block table (the group carries the block table
rows and lengths for it). It pads nothing, so there the decodes stay one
group, one kernel call per layer; the length split is built only for a layer
that gathers (`TorchNativeBatchPlan.gather_groups`).

A batch in which every request scores the same q > 1 tokens over a cached
context (a speculative verify step: the newest token and k drafts) runs on
the decode kernel too: q calls per layer, call i attending row i of every
request over its context plus rows 0..i (the calls run in order, so row i
sees the keys rows < i wrote). It reads only the metadata's tensors, so a
verify step is captured as a graph like a decode step (`uniform_query_len`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pagedllm.attention_backends import cpu_decode_kernel, cpu_prefill_kernel
from pagedllm.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention_backends.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv, read_kv, write_kv
from pagedllm.attention_backends.torch_native_plan import (
    MAX_UNIFORM_QUERY_LEN,
    MIN_PADDING_SAVING,
    RequestGroup,
    TorchNativeBatchPlan,
    TorchNativeMetadata,
    _decode_kernel_rows,
    build_batch_plan,
    split_by_length,
)
from pagedllm.platforms.cpu.graph import refuse_capture
from pagedllm.platforms.cpu.kernel_build import prebuild_in_background

if TYPE_CHECKING:
    from pagedllm.attention_backends.mla import MLAAttentionImpl



class TorchNativeAttentionImpl(AttentionImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A new machine's first builds overlap the model's loading.
        prebuild_in_background(cpu_decode_kernel.load)
        prebuild_in_background(cpu_prefill_kernel.load)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = attn_metadata.plan if isinstance(attn_metadata, TorchNativeMetadata) else None
        if plan is None:  # metadata not built by this backend: plan for this layer alone
            plan = build_batch_plan(attn_metadata, kv_cache.shape[2])
        num_tokens = plan.num_actual_tokens
        query, key, value = query[:num_tokens], key[:num_tokens], value[:num_tokens]

        # [2, num_blocks, block_size, Hkv, D] -> flat slots [num_blocks * block_size, Hkv, D]
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        kernel_runs = self._decode_kernel_runs(query, key_cache)
        if kernel_runs and plan.uniform_query_len is not None and cpu_decode_kernel.takes_new_kv(
                key, value, plan.slot_mapping, key_cache):
            return self._attend_uniform_queries(query, key, value, key_cache, value_cache, attn_metadata, plan)
        groups = plan.groups if kernel_runs else plan.gather_groups
        if kernel_runs and self._kernel_writes_kv(groups, key, value, key_cache, plan):
            # A whole batch of decodes on the kernel: it writes each request's
            # new key and value itself (none for slot -1), in its pass over
            # the request. All it reads are the metadata's tensors.
            return self._attend_group(query, key_cache, value_cache, groups[0], plan.block_size, kernel_runs,
                                      new_kv=(key, value, plan.slot_mapping))
        # The paths below index with host values of this batch (row lists,
        # lengths): a captured graph would replay them for every batch.
        refuse_capture("the cpu backend attends this batch with host-side indices, not the CPU decode kernel")
        # write_kv / read_kv: an fp8 cache converts on the way in and out.
        if plan.write_rows is None:
            write_kv(key_cache, plan.write_slots, key, self.k_scale)
            write_kv(value_cache, plan.write_slots, value, self.v_scale)
        else:
            write_kv(key_cache, plan.write_slots, key[plan.write_rows], self.k_scale)
            write_kv(value_cache, plan.write_slots, value[plan.write_rows], self.v_scale)

        if len(groups) == 1 and groups[0].token_rows is None:
            return self._attend_group(query, key_cache, value_cache, groups[0], plan.block_size, kernel_runs)
        # NOTE: every row belongs to one group or one fresh prefill, so every
        # row of `output` is written below.
        output = torch.empty_like(query)
        if plan.fresh_prefill_rows:
            self._attend_fresh_prefills(query, key, value, key_cache.dtype, plan, output)
        for group in groups:  # at most three: decodes (in one or two groups), prefill chunks with context
            assert group.token_rows is not None
            group_out = self._attend_group(query[group.token_rows], key_cache, value_cache, group, plan.block_size,
                                           kernel_runs)
            output.index_copy_(0, group.token_rows, group_out)
        return output

    def _attend_uniform_queries(
        self,
        query: torch.Tensor,  # [B * q, H, D], request by request
        key: torch.Tensor,  # [B * q, Hkv, D]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [slots, Hkv, D]
        value_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        plan: TorchNativeBatchPlan,
    ) -> torch.Tensor:  # [B * q, H, D]
        """Every request's q rows in one decode-kernel call: it writes all
        their keys and values (none for slot -1), then each row attends over
        the context up to and including itself. Reads only the metadata's
        tensors (a captured verify graph replays on new values)."""
        query_len = plan.uniform_query_len
        assert query_len is not None
        block_table, seq_lens = _decode_kernel_rows(attn_metadata, torch.empty(0), whole_batch=True)
        return cpu_decode_kernel.paged_decode(
            query, key_cache, value_cache, plan.block_size, block_table, seq_lens, self.scale, self.sliding_window,
            self.logits_soft_cap, (key, value, plan.slot_mapping), query_len=query_len, sinks=self.sinks,
        )

    def _decode_kernel_runs(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return cpu_decode_kernel.supports(query, key_cache, self.num_heads, self.num_kv_heads)

    @staticmethod
    def _kernel_writes_kv(
        groups: list[RequestGroup], key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
        plan: TorchNativeBatchPlan,
    ) -> bool:
        """With the decode kernel running: one group, the whole batch, all
        decodes (`seq_lens` is set only for those), every row written to
        the cache."""
        if len(groups) != 1 or groups[0].token_rows is not None or groups[0].seq_lens is None:
            return False
        return cpu_decode_kernel.takes_new_kv(key, value, plan.slot_mapping, key_cache)

    def _attend_fresh_prefills(
        self,
        query: torch.Tensor,  # [T, H, D], the whole batch
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,
        cache_dtype: torch.dtype,
        plan: TorchNativeBatchPlan,
        output: torch.Tensor,  # [T, H, D]; the fresh prefills' rows are written
    ) -> None:
        if is_fp8(cache_dtype):
            # Attend over what the cache holds, as every other row does.
            key = dequantize_kv(quantize_kv(key, cache_dtype, self.k_scale), query.dtype, self.k_scale)
            value = dequantize_kv(quantize_kv(value, cache_dtype, self.v_scale), query.dtype, self.v_scale)
        elif self._prefill_kernel_runs(query, key, value, plan):
            # Every fresh prefill in one call, straight into its output rows.
            cpu_prefill_kernel.prefill_attention(query, key, value, output, plan.fresh_prefill_bounds, self.scale,
                                                 sinks=self.sinks)
            return
        for start, end in plan.fresh_prefill_rows:
            output[start:end] = self._attend_fresh_prefill(query[start:end], key[start:end], value[start:end])

    def _prefill_kernel_runs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TorchNativeBatchPlan
    ) -> bool:
        return cpu_prefill_kernel.supports(query, key, value, self.num_heads, self.num_kv_heads, self.sliding_window,
                                           self.logits_soft_cap, plan.max_fresh_prefill_len)

    def _attend_fresh_prefill(
        self,
        query: torch.Tensor,  # [L, H, D], one request's whole prompt so far
        key: torch.Tensor,  # [L, Hkv, D]
        value: torch.Tensor,
    ) -> torch.Tensor:  # [L, H, D]
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, L, D]
        query_len = query.shape[0]
        if self._plain_softmax and (self.sliding_window is None or self.sliding_window >= query_len):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        else:
            positions = torch.arange(query_len, device=query.device)
            mask = positions[None, :] <= positions[:, None]
            if self.sliding_window is not None:
                mask &= positions[None, :] > positions[:, None] - self.sliding_window
            out = self._attention(q, k, v, mask)
        return out[0].transpose(0, 1)

    def _attend_group(
        self,
        query: torch.Tensor,  # [Tg, H, D]
        key_cache: torch.Tensor,  # [slots, Hkv, D]
        value_cache: torch.Tensor,
        group: RequestGroup,
        block_size: int,
        decode_kernel_runs: bool,  # _decode_kernel_runs, decided once per layer
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [Tg, H, D]
        num_reqs, max_query_len = group.num_reqs, group.max_query_len
        num_heads, num_kv_heads, head_size = self.num_heads, self.num_kv_heads, self.head_size
        if decode_kernel_runs and group.block_table is not None and group.seq_lens is not None:
            return cpu_decode_kernel.paged_decode(
                query, key_cache, value_cache, block_size, group.block_table, group.seq_lens, self.scale,
                self.sliding_window, self.logits_soft_cap, new_kv, sinks=self.sinks,
            )

        if group.padded_rows is None:
            padded_query = query
        else:
            padded_query = query.new_zeros(num_reqs * max_query_len, num_heads, head_size)
            padded_query.index_copy_(0, group.padded_rows, query)
        q = padded_query.view(num_reqs, max_query_len, num_heads, head_size).transpose(1, 2)  # [B, H, max_q, D]
        # [B * S, Hkv, D] -> [B, Hkv, S, D]; index_select is ~8x faster than
        # advanced indexing with a 2-D index on CPU.
        kv_shape = (num_reqs, group.max_seq_len, num_kv_heads, head_size)
        k = read_kv(key_cache, group.flat_key_slots, query.dtype, self.k_scale).view(kv_shape).transpose(1, 2)
        v = read_kv(value_cache, group.flat_key_slots, query.dtype, self.v_scale).view(kv_shape).transpose(1, 2)
        out = self._attention(q, k, v, group.mask(self.sliding_window))
        out = out.transpose(1, 2).reshape(num_reqs * max_query_len, num_heads, head_size)
        if group.padded_rows is None:
            return out
        return out.index_select(0, group.padded_rows)

    def _attention(
        self,
        q: torch.Tensor,  # [B, H, Lq, D]
        k: torch.Tensor,  # [B, Hkv, Lk, D]
        v: torch.Tensor,
        mask: torch.Tensor,  # bool, broadcast to [B, H, Lq, Lk]; True = attend
    ) -> torch.Tensor:  # [B, H, Lq, D]
        if self._plain_softmax:
            # enable_gqa: each KV head serves its query heads without repeating K/V.
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        group_size = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
        # The sink: one more logit per head in the softmax, its probability dropped.
        sinks = self.sinks.detach().float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(probs, v.float()).to(q.dtype)

    @property
    def _plain_softmax(self) -> bool:
        """Whether SDPA computes this layer's attention (no soft cap, no sinks)."""
        return self.logits_soft_cap is None and self.sinks is None


class TorchNativeBackend(AttentionBackend):
    name = "cpu"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchNativeAttentionImpl

    @classmethod
    def get_mla_impl_cls(cls) -> type[MLAAttentionImpl]:
        from pagedllm.attention_backends.torch_mla import TorchMLAImpl

        return TorchMLAImpl

    @classmethod
    def supports_graph_capture(cls, block_size: int) -> bool:
        # Whole batches of decodes on the CPU decode kernel read only the
        # metadata's tensors; any other path refuses at capture time
        # (refuse_capture), and the steps then run eagerly.
        return True

    @classmethod
    def supports_uniform_query_capture(cls, block_size: int) -> bool:
        # Verify steps run on the decode kernel, all rows in one call (uniform_query_len).
        return True

    @classmethod
    def build_metadata(cls, common: AttentionMetadata, block_size: int) -> TorchNativeMetadata:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(AttentionMetadata)}
        return TorchNativeMetadata(**fields, plan=build_batch_plan(common, block_size))


# The batch plan's names, where they were defined before torch_native_plan.py.
__all__ = [
    "MAX_UNIFORM_QUERY_LEN", "MIN_PADDING_SAVING", "RequestGroup", "TorchNativeAttentionImpl", "TorchNativeBackend",
    "TorchNativeBatchPlan", "TorchNativeMetadata", "build_batch_plan", "split_by_length",
]
