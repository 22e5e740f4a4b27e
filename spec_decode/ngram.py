"""n-gram drafting (prompt lookup decoding, Saxena 2023).

Find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the
last n tokens occurred earlier in prompt + output; of its occurrences take the
earliest; propose the (up to k) tokens that followed it. No model, no KV, no
probabilities (q is one-hot).

The drafter matches the whole batch at once: the requests' tokens, padded on
the left into one [B, L] matrix so that every row ends in the same column, are
compared with their last n tokens in max_n vectorised passes
(`batch_ngram_propose`). `ngram_propose` is the same rule for one sequence.
Each request's tokens are kept as a growing array (`TokenBuffer`) so a step
converts only its new tokens; `finish_requests` drops them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.spec_decode.interface import Drafter, DrafterContext, DraftInputs, DraftOutput

if TYPE_CHECKING:
    from pagedllm.core.config import SpeculativeConfig

# Left padding of the batch matrix: never equal to a token id.
_PAD = -1


def suffix_match_lengths(tokens: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ends, match_len): for every earlier position e (exclusive end, e <
    len(tokens)), how many tokens before e equal the sequence's last ones,
    capped at max_n. One vectorized pass for all n at once."""
    num_tokens = len(tokens)
    ends = np.arange(1, num_tokens)
    match_len = np.zeros(num_tokens - 1, dtype=np.int64)
    still_matching = np.ones(num_tokens - 1, dtype=bool)
    for j in range(1, min(max_n, num_tokens - 1) + 1):
        still_matching &= (ends >= j) & (tokens[np.maximum(ends - j, 0)] == tokens[num_tokens - j])
        if not still_matching.any():
            break
        match_len += still_matching
    return ends, match_len


def ngram_propose(token_ids: np.ndarray | list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The drafts for one sequence (see the module docstring)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    if len(tokens) < 2 or k <= 0 or max_n < min_n:
        return []
    ends, match_len = suffix_match_lengths(tokens, max_n)
    best_n = int(match_len.max())
    if best_n < min_n:
        return []
    end = int(ends[np.argmax(match_len == best_n)])  # the earliest longest match
    return tokens[end : end + k].tolist()


def _left_padded(token_ids: Sequence[Sequence[int] | np.ndarray], lengths: np.ndarray) -> np.ndarray:
    """[B, L] int64, row i's tokens in its last lengths[i] columns, _PAD before."""
    width = int(lengths.max())
    matrix = np.full((len(token_ids), width), _PAD, dtype=np.int64)
    for row, tokens in enumerate(token_ids):
        if len(tokens):
            matrix[row, width - len(tokens) :] = tokens
    return matrix


class TokenBuffer:
    """A request's tokens as a growing int64 array, so that each step converts
    only the new tokens (converting ~1k Python ints costs more than the match)."""

    def __init__(self) -> None:
        self.array = np.empty(0, dtype=np.int64)
        self.num_tokens = 0

    def update(self, token_ids: Sequence[int]) -> np.ndarray:
        """The tokens as an array view, after appending those not seen yet (or
        rebuilding, when `token_ids` does not extend what was seen)."""
        n = self.num_tokens
        if len(token_ids) < n or (n and token_ids[n - 1] != self.array[n - 1]) or (n and token_ids[0] != self.array[0]):
            n = self.num_tokens = 0
        new = token_ids[n:]
        if n + len(new) > len(self.array):
            grown = np.empty(max(2 * len(self.array), n + len(new), 64), dtype=np.int64)
            grown[:n] = self.array[:n]
            self.array = grown
        self.array[n : n + len(new)] = new
        self.num_tokens = n + len(new)
        return self.array[: self.num_tokens]


def batch_match_lengths(matrix: np.ndarray, max_n: int) -> np.ndarray:
    """[B, L - 1]: at column c (an occurrence ending before column c + 1),
    how many tokens equal the row's last ones, capped at max_n.

    Padding never matches a token, so a window reaching into a row's padding
    stops there, exactly as `suffix_match_lengths` stops at position 0."""
    num_rows, width = matrix.shape
    last = width - 1  # the column every row ends in
    match_len = np.zeros((num_rows, width - 1), dtype=np.int64)
    still_matching = np.ones((num_rows, width - 1), dtype=bool)
    for j in range(1, min(max_n, width - 1) + 1):
        # Occurrence ends e = c + 1 for c in [0, L - 1): compare column e - j
        # with the row's j-th last token; columns with e - j < 0 do not exist.
        window = still_matching[:, j - 1 :]
        window &= matrix[:, : width - j] == matrix[:, last - j + 1, None]
        still_matching[:, : j - 1] = False
        if not window.any():
            break
        match_len += still_matching
    return match_len


def batch_ngram_propose(
    token_ids: Sequence[Sequence[int] | np.ndarray], min_n: int, max_n: int, ks: Sequence[int]
) -> list[list[int]]:
    """`ngram_propose(token_ids[i], min_n, max_n, ks[i])` for every i, in one
    vectorised pass over the batch."""
    drafts: list[list[int]] = [[] for _ in token_ids]
    lengths = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
    rows = [i for i, (n, k) in enumerate(zip(lengths, ks, strict=True)) if n >= 2 and k > 0]
    if not rows or max_n < min_n:
        return drafts
    lengths = lengths[rows]
    matrix = _left_padded([token_ids[i] for i in rows], lengths)
    match_len = batch_match_lengths(matrix, max_n)
    best_n = match_len.max(axis=1)
    earliest = np.argmax(match_len == best_n[:, None], axis=1)  # first column of the longest match
    # Column c ends the occurrence at e = c + 1 - (L - n) in the row's own positions.
    ends = earliest + 1 - (matrix.shape[1] - lengths)
    for j, row in enumerate(rows):
        if best_n[j] >= min_n:
            end = int(ends[j]) if best_n[j] else 1  # min_n 0: no match, the first end
            tokens = token_ids[row][end : end + ks[row]]
            drafts[row] = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    return drafts


class NgramDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        self.buffers: dict[str, TokenBuffer] = {}

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        config = self.config
        k = self.num_speculative_tokens
        max_model_len = self.context.max_model_len if self.context is not None else None
        # The policy's count per request (k without one), capped by max_model_len.
        wanted = inputs.num_drafts or [k] * len(inputs.token_ids)
        ks = [k_i if max_model_len is None else max(0, min(k_i, max_model_len - len(t)))
              for k_i, t in zip(wanted, inputs.token_ids, strict=True)]
        token_arrays = [
            self.buffers.setdefault(req_id, TokenBuffer()).update(token_ids)
            for req_id, token_ids in zip(inputs.req_ids, inputs.token_ids, strict=True)
        ]
        return DraftOutput(batch_ngram_propose(token_arrays, config.prompt_lookup_min, config.prompt_lookup_max, ks))

    def finish_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.buffers.pop(req_id, None)
