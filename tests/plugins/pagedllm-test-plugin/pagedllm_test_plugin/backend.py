"""An attention backend that does no attention: each token gets its own value.

Useful to prove that a plugin backend is really the one the engine runs
(``TestEchoBackend.num_forward_calls`` counts calls) while still keeping the
paged KV cache contract (new K/V written at ``slot_mapping``).
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

import torch

from pagedllm.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.plugins import get_plugin_manager
from pagedllm_test_plugin.options import TestPluginOptions


class TestEchoImpl(AttentionImpl):
    __test__ = False  # not a pytest test class
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        TestEchoBackend.num_forward_calls += 1
        num_tokens = attn_metadata.num_actual_tokens
        slots = attn_metadata.slot_mapping[:num_tokens]
        valid = slots >= 0
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        key_cache[slots[valid]] = key[:num_tokens][valid].to(kv_cache.dtype)
        value_cache[slots[valid]] = value[:num_tokens][valid].to(kv_cache.dtype)
        group = self.num_heads // self.num_kv_heads
        return value.repeat_interleave(group, dim=1)


class TestEchoBackend(AttentionBackend):
    __test__ = False  # not a pytest test class
    name: ClassVar[str] = "test_echo"
    num_forward_calls: ClassVar[int] = 0

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        _record_options()
        return TestEchoImpl


def _record_options() -> None:
    """Append the plugin options this process handed the backend, with the
    process id, to ``record_path`` (JSON lines: one per attention layer
    built, from every process that builds one), when the user set one."""
    options = get_plugin_manager().plugin_config(TestPluginOptions)
    if options.record_path is not None:
        record = {"pid": os.getpid(), "options": options.model_dump(mode="json")}
        with open(options.record_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
