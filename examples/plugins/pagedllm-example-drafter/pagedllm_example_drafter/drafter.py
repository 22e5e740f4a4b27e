"""The suffix-window drafter: the longest suffix n-gram (prompt_lookup_min <=
n <= prompt_lookup_max) that occurs in the last `window` tokens, its most
recent occurrence, and the (up to k) tokens that followed it."""

from __future__ import annotations

import os

import numpy as np

from pagedllm.spec_decode import Drafter, DraftInputs, DraftOutput
from pagedllm.spec_decode.ngram import suffix_match_lengths

DEFAULT_WINDOW = 256


def suffix_window_propose(token_ids: list[int], min_n: int, max_n: int, k: int, window: int) -> list[int]:
    tokens = np.asarray(token_ids[-window:], dtype=np.int64)
    num_tokens = len(tokens)
    if num_tokens < 2 or k <= 0:
        return []
    # match_len[e]: how long a suffix of the context ends (exclusive) at e < num_tokens.
    ends, match_len = suffix_match_lengths(tokens, max_n)
    best_n = int(match_len.max())
    if best_n < min_n:
        return []
    # The most recent longest match (the last index with that length).
    end = int(ends[len(match_len) - 1 - np.argmax(match_len[::-1] == best_n)])
    return tokens[end : end + k].tolist()


class SuffixWindowDrafter(Drafter):
    def __init__(self, config, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.window = int(os.environ.get("PAGEDLLM_SUFFIX_WINDOW", DEFAULT_WINDOW))

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        config = self.config
        max_model_len = self.context.max_model_len if self.context is not None else None
        drafts = []
        for token_ids in inputs.token_ids:
            k = self.num_speculative_tokens
            if max_model_len is not None:
                k = max(0, min(k, max_model_len - len(token_ids)))
            drafts.append(
                suffix_window_propose(token_ids, config.prompt_lookup_min, config.prompt_lookup_max, k, self.window)
            )
        return DraftOutput(drafts)
