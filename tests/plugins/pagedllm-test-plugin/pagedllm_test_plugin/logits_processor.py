"""``ban_recent``: a request with ``extra_args={"ban_recent_tokens": k}`` never
samples one of its last k tokens (prompt and output). It reads the output
tokens at every step, so under speculative decoding each draft position must
see the drafts before it (tests/test_logits_processors.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.logits_processors.interface import BatchUpdate, LogitsProcessor, extra_arg

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams

ARG = "ban_recent_tokens"
MAX_BAN = 64


def recent_tokens(prompt: Sequence[int], output: Sequence[int], count: int) -> list[int]:
    return [*prompt, *output][-count:]


class BanRecentTokens(LogitsProcessor):
    example_args: ClassVar[dict[str, int]] = {ARG: 3}  # for the conformance kit

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.rows: dict[int, tuple[int, Sequence[int], Sequence[int]]] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        count = extra_arg(params, ARG)
        if count is not None and (type(count) is not int or not 1 <= count <= MAX_BAN):
            raise InvalidRequestError(f"extra_args.{ARG}", count, f"must be an integer in [1, {MAX_BAN}]")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.rows = batch_update.remap(self.rows)
        for added in batch_update.added:
            count = extra_arg(added.params, ARG)
            if count is None:
                self.rows.pop(added.row_index, None)
            else:
                self.rows[added.row_index] = (count, added.prompt_token_ids, added.output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (count, prompt, output) in self.rows.items():
            banned = [t for t in recent_tokens(prompt, output, count) if t < logits.shape[-1]]
            logits[row, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
        return logits
