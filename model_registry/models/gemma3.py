"""Gemma 3 (Gemma Team, 2025), the text model (`Gemma3ForCausalLM`,
model_type gemma3_text): Gemma 2 with a GemmaRMSNorm over each head of q and
k before RoPE, five sliding-window layers per global one (`layer_types`), and
two rotary tables: the sliding layers' base is `rope_local_base_freq`
(10,000), the global layers' is `rope_theta` (1,000,000) with their scaling
(linear, factor 8, in the released configs). The final logits are
soft-capped when the config sets a cap; attention scores are not (see
`GemmaFlags.attn_soft_cap`)."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.model_registry.models.gemma2 import Gemma2ForCausalLM, GemmaFlags


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gemma_flags: ClassVar[GemmaFlags] = GemmaFlags(qk_norm=True, attn_soft_cap=False, rope_per_layer_type=True)
