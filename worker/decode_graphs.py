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
        num_kv_cache_groups: int = 1,
    ) -> None:
        get_aux = getattr(model, "get_aux_hidden_states", None)

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            hidden_states = model(input_ids, positions, metadata)
            # The layer inputs an EAGLE-3 drafter asked the model to keep: an
            # output of the graph too, so that each replay refreshes them.
            aux = None if get_aux is None else get_aux()
            return (hidden_states,) if aux is None else (hidden_states, aux)

        super().__init__(forward, attn_backend, platform, sizes=sizes, max_model_len=max_model_len,
                         block_size=block_size, device=device, query_lens=query_lens,
                         num_kv_cache_groups=num_kv_cache_groups)
        self.model = model
        # The kept layer inputs of the last step that replayed (None: it ran eagerly, or none are kept).
        self.replayed_aux: torch.Tensor | None = None

    def run_model(self, input_ids: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """Hidden states [n * q, hidden] of a uniform step of n requests."""
        outputs = self.run(input_ids, batch)
        self.replayed_aux = outputs[1] if len(outputs) > 1 else None
        return outputs[0]


__all__ = ["DecodeGraphRunner", "default_graph_sizes"]
