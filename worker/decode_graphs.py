"""The model runner's graphs: the target model's forward over uniform decode
and verify batches (model_registry/batch_graphs.py captures and replays)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.model_registry.batch_graphs import BatchGraphs, default_graph_sizes

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.model_registry.input_batch import InputBatch
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.platforms.interface import Platform


class DecodeGraphRunner(BatchGraphs):
    def __init__(
        self,
        model: ModelForCausalLM,
        attn_backend: type[AttentionBackend],
        platform: Platform,
        *,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        query_lens: list[int] | None = None,
    ) -> None:
        def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return (model(input_ids, positions, metadata),)

        super().__init__(forward, attn_backend, platform, sizes=sizes, max_model_len=max_model_len,
                         block_size=block_size, device=device, query_lens=query_lens)
        self.model = model

    def run_model(self, input_ids: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """Hidden states [n * q, hidden] of a uniform step of n requests."""
        return self.run(input_ids, batch)[0]


__all__ = ["DecodeGraphRunner", "default_graph_sizes"]
