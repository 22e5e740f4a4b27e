"""The per-request token controls of vLLM's SamplingParams that act on one
step's logits rows: `allowed_token_ids` (every other token masked),
`bad_words` (as `bad_words_token_ids`: a word's last token masked when the
tokens before it are the last ones generated) and `logprob_token_ids` (the
logprobs of exactly these tokens in place of the top-k).

`TokenControls.build` returns None when no row uses any of them, so a batch
without them pays one pass over its params when the batch changes, and
nothing per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenControls:
    # (rows, mask [R, V] bool): True where a token is outside the row's allowed_token_ids.
    disallowed: tuple[torch.Tensor, torch.Tensor] | None
    # (rows, token ids): the bad-word tokens each row may not sample at this step.
    bad_word_bans: tuple[torch.Tensor, torch.Tensor] | None
    # NOTE: bad-word bans follow the output, so metadata holding them is rebuilt every step.
    depends_on_output: bool
    # (rows, ids [R, K] long): the rows' logprob_token_ids, padded with their first id.
    logprob_token_ids: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> TokenControls | None:
        if not any(p.allowed_token_ids or p.bad_words_token_ids or p.logprob_token_ids for p in params):
            return None
        return cls(
            disallowed=_disallowed(params, vocab_size, device),
            bad_word_bans=_bad_word_bans(params, output_token_ids, vocab_size, device),
            depends_on_output=any(p.bad_words_token_ids for p in params),
            logprob_token_ids=explicit_logprob_token_ids(params, vocab_size, device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the masked tokens at -inf (out of place: the caller
        may still read the raw logits)."""
        if self.disallowed is not None:
            rows, mask = self.disallowed
            logits = logits.index_put((rows,), logits[rows].masked_fill(mask, float("-inf")))
        if self.bad_word_bans is not None:
            rows, token_ids = self.bad_word_bans
            logits = logits.index_put((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))
        return logits


def _disallowed(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    mask = torch.ones((len(rows), vocab_size), dtype=torch.bool)
    for mask_row, row in enumerate(rows):
        # Validation refuses ids past the vocabulary (validate_vocab); never index past it.
        allowed = [t for t in params[row].allowed_token_ids or () if t < vocab_size]
        mask[mask_row, torch.tensor(allowed, dtype=torch.long)] = False
    return torch.tensor(rows, dtype=torch.long, device=device), mask.to(device)


def _bad_word_bans(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """vLLM's rule: a sequence's last token is banned when the tokens before
    it end the row's output (always, for a one-token sequence)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, p in enumerate(params):
        output = output_token_ids[row]
        for sequence in p.bad_words_token_ids or ():
            prefix_len = len(sequence) - 1
            if prefix_len > len(output) or sequence[-1] >= vocab_size:
                continue
            if prefix_len == 0 or list(output[len(output) - prefix_len :]) == sequence[:-1]:
                rows.append(row)
                token_ids.append(sequence[-1])
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(token_ids, dtype=torch.long, device=device))


def explicit_logprob_token_ids(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids [R, K]) of the rows with logprob_token_ids; None when none has them."""
    rows = [row for row, p in enumerate(params) if p.logprob_token_ids]
    if not rows:
        return None
    width = max(len(params[row].logprob_token_ids or ()) for row in rows)
    padded = []
    for row in rows:
        # NOTE: ids past the vocabulary are refused by validate_vocab; clamp, never index past it.
        ids = [min(t, vocab_size - 1) for t in params[row].logprob_token_ids or ()]
        padded.append(ids + [ids[0]] * (width - len(ids)))
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(padded, dtype=torch.long, device=device))
