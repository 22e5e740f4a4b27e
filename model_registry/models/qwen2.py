"""Qwen2 (Yang et al., 2024): Llama with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from typing import ClassVar

from pagedllm.model_registry.models.llama import LlamaFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    flags: ClassVar[LlamaFlags] = LlamaFlags(qkv_bias=True, o_proj_bias=False)
