"""A smaller model of the same vocabulary proposes the drafts.

The catch-up runs the draft model over the target's rows of this step minus
the rejected drafts, plus, for each request that drafts, its newest token at
the next position: the logits there give draft 1. Each further draft feeds
the previous one at the next position (spec_decode/model_drafter.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.input_batch import InputBatch
from pagedllm.spec_decode.model_drafter import DraftStart, ModelDrafter, load_draft_hf_config

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionMetadata
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.spec_decode.interface import DrafterContext, DraftInputs, TargetStep


class DraftModelDrafter(ModelDrafter):
    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        from pagedllm.model_registry.loader import get_architecture, load_model
        from pagedllm.plugins import get_plugin_manager

        path, hf_config = load_draft_hf_config(config, self.method)
        if hf_config.vocab_size != context.vocab_size:
            raise ConfigError(
                "speculative.model", config.model,
                f"a model with the target's vocabulary ({context.vocab_size} tokens, "
                f"this one has {hf_config.vocab_size})",
            )
        model_cls = get_plugin_manager().models.load(get_architecture(hf_config))
        self.model = cast("ModelForCausalLM", load_model(
            path, model_cls=model_cls, attn_backend=context.attn_backend, dtype=context.dtype,
            device=context.device, hf_config=hf_config,
        ))
        self.kv_caches = self._allocate_kv_caches(self.model)

    def _catch_up(self, inputs: DraftInputs, step: TargetStep, drafting: list[int]) -> DraftStart | None:
        device = self.context.device
        num_batch = len(step.req_ids)
        drafting_rows = [inputs.batch_rows[i] for i in drafting]
        # The target's kept rows, plus one row per drafting request for its newest token.
        kept_lens = np.diff(step.query_start_loc) - step.num_rejected
        query_lens = kept_lens.copy()
        query_lens[drafting_rows] += 1
        out_start = np.zeros(num_batch + 1, dtype=np.int64)
        np.cumsum(query_lens, out=out_start[1:])
        # Interleave: request b's kept rows, then its extra row when it drafts.
        kept = np.concatenate([np.arange(step.query_start_loc[b], step.query_start_loc[b] + kept_lens[b])
                               for b in range(num_batch)]).astype(np.int64)
        kept_dest = np.concatenate([np.arange(out_start[b], out_start[b] + kept_lens[b])
                                    for b in range(num_batch)]).astype(np.int64)
        input_ids = torch.empty(int(out_start[-1]), dtype=torch.long, device=device)
        input_ids[torch.from_numpy(kept_dest).to(device)] = step.input_ids[torch.from_numpy(kept).to(device)]
        positions = np.empty(int(out_start[-1]), dtype=np.int64)
        positions[kept_dest] = step.positions[kept]
        last_rows = np.array([out_start[b + 1] - 1 for b in drafting_rows], dtype=np.int64)
        if drafting:
            newest = [inputs.token_ids[i][-1] for i in drafting]
            input_ids[torch.from_numpy(last_rows).to(device)] = torch.tensor(newest, device=device)
            positions[last_rows] = positions[last_rows - 1] + 1
        batch = InputBatch.from_positions(positions, query_lens, step.block_table, self.context.block_size)
        replayed = self._replay_catch_up(input_ids, None, batch, last_rows)
        if replayed is not None:
            return DraftStart(None, None, positions[last_rows] + 1, logits=replayed[0]) if drafting else None
        hidden_states = self.model(input_ids, *self._to_device(batch))
        if not drafting:
            return None
        return DraftStart(hidden_states[torch.from_numpy(last_rows).to(device)], None, positions[last_rows] + 1)

    def _draft_forward(
        self, tokens: torch.Tensor, hidden_states: torch.Tensor | None, positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden_states = self.model(tokens, positions, attn_metadata)
        return self._compute_logits(hidden_states), None

    def _compute_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(outputs)
