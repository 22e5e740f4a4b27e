"""A model whose next token is scripted: the built-in Llama graph runs (so
the KV cache, the scheduler and the sampler see a real model), but the
logits come from a table in config.json keyed by the current input token:

    "script": {"<token id>": [next token ids, most preferred first]},
    "script_default": [ids for any token the table does not name]

The most preferred id gets logit 100, the next 99, ...; every other token 0.
So greedy decoding follows the script, and under a grammar that masks the
first choice the next allowed one wins: a test can script what a reasoning
model writes (the tiny models never write ``<think>`` by themselves).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.model_registry.models.llama import LlamaForCausalLM

TOP_LOGIT = 100.0


class TestScriptedForCausalLM(LlamaForCausalLM):
    __test__ = False  # not a pytest test class

    def __init__(self, hf_config: Any, attn_backend: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config, attn_backend, dtype=dtype)
        self.vocab_size = hf_config.vocab_size
        self.script = {int(token): list(choices) for token, choices in getattr(hf_config, "script", {}).items()}
        self.script_default = list(getattr(hf_config, "script_default", []))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, attn_metadata).clone()
        # The runner picks the rows it samples from; each row carries its input token.
        hidden[:, 0] = input_ids.to(hidden.dtype)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden_states.shape[0], self.vocab_size, device=hidden_states.device)
        for row, token in enumerate(hidden_states[:, 0].round().long().tolist()):
            for rank, choice in enumerate(self.script.get(token, self.script_default)):
                logits[row, choice] = TOP_LOGIT - rank
        return logits
