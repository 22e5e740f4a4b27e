"""Qwen3 (Yang et al., 2025): Llama with a per-head RMSNorm on q and k before
RoPE; biases follow config.attention_bias."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.model_registry.models.llama import LlamaFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags(qk_norm=True)
