"""Logits of the sampled positions from a vocabulary-parallel LM head.

Each rank computes the logits of its vocabulary range; they are ALL-GATHERED,
so every rank holds the full [N, vocab] logits. Why all ranks and not only the
sampling rank: each rank runs the sampler and the drafter (as in vLLM V1), so
each rank's input batch advances with the same tokens and draft tokens without
a broadcast of the sampled ids after every step; gloo and NCCL all-gather give
bit-identical tensors on every rank, and with the same seeds the samplers agree.

(vLLM calls this layer LogitsProcessor; here that name is the plugin kind
that edits logits before sampling, logits_processors/interface.py.)
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead


class LogitsHead(nn.Module):
    def __init__(self, vocab_size: int, soft_cap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # Final-logit soft-capping (Gemma 2): soft_cap * tanh(logits / soft_cap).
        self.soft_cap = soft_cap

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> logits [N, vocab] in the model's dtype."""
        logits = lm_head.apply_linear(hidden_states, lm_head.bias)  # [N, vocab / tp]
        if lm_head.tp_size > 1:
            logits = lm_head.tp_group.all_gather(logits, dim=-1)  # [N, per_rank * tp]
            logits = logits[..., : self.vocab_size]  # drop the last rank's padding rows
        if self.soft_cap is not None:
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        return logits
