"""n-gram drafting (prompt lookup decoding, Saxena 2023).

Find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the
last n tokens occurred earlier in prompt + output; of its occurrences take the
earliest; propose the (up to k) tokens that followed it. No model, no KV, no
probabilities (q is one-hot).
"""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.interface import Drafter, DraftInputs, DraftOutput


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


class NgramDrafter(Drafter):
    def propose(self, inputs: DraftInputs) -> DraftOutput:
        config = self.config
        k = self.num_speculative_tokens
        max_model_len = self.context.max_model_len if self.context is not None else None
        drafts = []
        for token_ids in inputs.token_ids:
            num_drafts = k if max_model_len is None else max(0, min(k, max_model_len - len(token_ids)))
            drafts.append(
                ngram_propose(token_ids, config.prompt_lookup_min, config.prompt_lookup_max, num_drafts)
                if num_drafts
                else []
            )
        return DraftOutput(drafts)
