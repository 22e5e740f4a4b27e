"""n-gram (prompt lookup) drafting: exact cases."""

from __future__ import annotations

import time

import numpy as np

from pagedllm.core.config import SpeculativeConfig
from pagedllm.spec_decode.interface import DraftInputs
from pagedllm.spec_decode.ngram import NgramDrafter, ngram_propose


def test_bigram_suffix_proposes_what_followed_it() -> None:
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_longest_ngram_beats_a_shorter_one() -> None:
    # Suffix [7, 8, 9]: the unigram 9 occurs first (followed by 1), the
    # trigram later (followed by 5).
    tokens = [9, 1, 7, 8, 9, 5, 6, 0, 7, 8, 9]
    assert ngram_propose(tokens, 1, 3, 2) == [5, 6]
    assert ngram_propose(tokens, 1, 1, 2) == [1, 7]


def test_earliest_match_wins_ties() -> None:
    tokens = [4, 5, 1, 4, 5, 2, 4, 5]
    assert ngram_propose(tokens, 2, 2, 1) == [1]


def test_nothing_on_empty_or_too_short_context() -> None:
    assert ngram_propose([], 1, 3, 3) == []
    assert ngram_propose([1], 1, 3, 3) == []
    assert ngram_propose([1, 2, 3], 1, 3, 3) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1, 2], 3, 4, 3) == []  # only a bigram matches


def test_proposal_stops_at_the_end_of_the_context() -> None:
    assert ngram_propose([1, 2, 1], 1, 1, 5) == [2, 1]


def test_drafter_batch_is_fast_for_hundreds_of_requests() -> None:
    rng = np.random.default_rng(0)
    token_ids = [rng.integers(0, 50, size=1000).tolist() for _ in range(256)]
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4), None)  # type: ignore[arg-type]
    start = time.perf_counter()
    out = drafter.propose(DraftInputs(req_ids=[str(i) for i in range(256)], token_ids=token_ids, sampling_params=[]))
    elapsed = time.perf_counter() - start
    assert len(out.draft_token_ids) == 256
    assert all(len(d) <= 4 for d in out.draft_token_ids)
    print(f"256 requests x 1000 tokens: {elapsed * 1000:.1f} ms")
