"""The model runner's graphs: the target model's forward over uniform decode
and verify batches (model_registry/batch_graphs.py captures and replays).

With LoRA enabled each row's adapter slot is a per-row input of the graph
(`lora_token_slots`; padding rows slot 0): the captured forward points the
layers' `LoRABatchState.token_slots` at that buffer, so every graph holds
the adapter products and a replay serves any mix of adapters and base rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.model_registry.batch_graphs import BatchGraphs, default_graph_sizes

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionMetadata
    from pagedllm.model_registry.input_batch import InputBatch
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.model_registry.layers.lora import LoRABatchState
    from pagedllm.platforms.interface import Platform


# The graphs' per-row input of adapter slots (with LoRA enabled).
LORA_TOKEN_SLOTS = "lora_token_slots"


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
        lora_state: LoRABatchState | None = None,
    ) -> None:
        get_aux = getattr(model, "get_aux_hidden_states", None)

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            if lora_state is not None:
                lora_state.token_slots = extras[LORA_TOKEN_SLOTS]
            hidden_states = model(input_ids, positions, metadata)
            # The layer inputs an EAGLE-3 drafter asked the model to keep: an
            # output of the graph too, so that each replay refreshes them.
            aux = None if get_aux is None else get_aux()
            return (hidden_states,) if aux is None else (hidden_states, aux)

        super().__init__(forward, attn_backend, platform, sizes=sizes, max_model_len=max_model_len,
                         block_size=block_size, device=device, query_lens=query_lens,
                         num_kv_cache_groups=num_kv_cache_groups,
                         extra_inputs=None if lora_state is None else {LORA_TOKEN_SLOTS: ((), torch.int32)})
        self.model = model
        self.lora_state = lora_state
        # The kept layer inputs of the last step that replayed (None: it ran eagerly, or none are kept).
        self.replayed_aux: torch.Tensor | None = None

    def run_model(self, input_ids: torch.Tensor, batch: InputBatch,
                  lora_token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [n * q, hidden] of a uniform step of n requests
        (`lora_token_slots`: each row's adapter slot, with LoRA enabled;
        None: slot 0, no adapter, in every row)."""
        extras = None
        if self.lora_state is not None:
            if lora_token_slots is None:
                lora_token_slots = torch.zeros(batch.num_tokens, dtype=torch.int32, device=self.input_ids.device)
            extras = {LORA_TOKEN_SLOTS: lora_token_slots}
        outputs = self.run(input_ids, batch, extras)
        self.replayed_aux = outputs[1] if len(outputs) > 1 else None
        return outputs[0]


__all__ = ["DecodeGraphRunner", "default_graph_sizes"]
