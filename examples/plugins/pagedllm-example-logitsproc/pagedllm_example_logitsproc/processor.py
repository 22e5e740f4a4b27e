"""``no_repeat_ngram``: a request with ``no_repeat_ngram_size = n`` never
produces an n-gram that already occurs in its prompt and output (Hugging
Face's ``NoRepeatNGramLogitsProcessor``, per request)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.logits_processors.interface import BatchUpdate, LogitsProcessor, extra_arg

from pagedllm_example_logitsproc import ARG

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams

MAX_NGRAM_SIZE = 64


def banned_tokens(token_ids: Sequence[int], ngram_size: int) -> set[int]:
    """The tokens that would complete an n-gram already in `token_ids`: every
    token that followed an earlier occurrence of the last n - 1 tokens."""
    num_tokens = len(token_ids)
    if num_tokens + 1 < ngram_size:
        return set()
    prefix = list(token_ids[num_tokens - ngram_size + 1 :]) if ngram_size > 1 else []
    return {
        token_ids[start + ngram_size - 1]
        for start in range(num_tokens - ngram_size + 1)
        if list(token_ids[start : start + ngram_size - 1]) == prefix
    }


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    example_args: ClassVar[dict[str, int]] = {ARG: 2}  # for the conformance kit

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        # row -> (n, prompt ids, live output ids) of the rows that passed the argument
        self.rows: dict[int, tuple[int, Sequence[int], Sequence[int]]] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        size = extra_arg(params, ARG)
        if size is not None and (type(size) is not int or not 1 <= size <= MAX_NGRAM_SIZE):
            raise InvalidRequestError(f"extra_args.{ARG}", size, f"must be an integer in [1, {MAX_NGRAM_SIZE}]")

    def is_argmax_invariant(self) -> bool:
        return False  # it bans tokens, the argmax among them

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.rows = batch_update.remap(self.rows)
        for added in batch_update.added:
            size = extra_arg(added.params, ARG)
            if size is None:
                self.rows.pop(added.row_index, None)
            else:
                self.rows[added.row_index] = (size, added.prompt_token_ids, added.output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        token_ids: list[int] = []
        vocab_size = logits.shape[-1]
        for row, (size, prompt, output) in self.rows.items():
            for token_id in sorted(banned_tokens([*prompt, *output], size)):
                if token_id < vocab_size:
                    rows.append(row)
                    token_ids.append(token_id)
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)] = float("-inf")
        return logits
