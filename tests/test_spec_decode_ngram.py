"""n-gram (prompt lookup) drafting: exact cases."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from pagedllm.core.config import SpeculativeConfig
from pagedllm.spec_decode.interface import DraftInputs
from pagedllm.spec_decode.ngram import NgramDrafter, batch_ngram_propose, ngram_propose


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


def _random_and_adversarial_batches() -> list[list[list[int]]]:
    rng = np.random.default_rng(1)
    batches = [
        [rng.integers(0, vocab, size=int(rng.integers(0, 60))).tolist() for _ in range(int(rng.integers(1, 10)))]
        for vocab in (2, 3, 7, 1000)
        for _ in range(50)
    ]
    # Adversarial: one token repeated (every window matches), lengths 0..3
    # beside a long row (padding next to real tokens), a match that is the
    # sequence's own prefix, rows identical but for the last token.
    batches.append([[5] * 40, [], [5], [5, 5], [1, 5, 5], [5] * 3])
    batches.append([[1, 2, 3, 1, 2, 3, 1, 2], [9] * 200, [2, 1]])
    batches.append([[4, 5, 6, 7, 4, 5, 6, 8], [4, 5, 6, 7, 4, 5, 6, 7], [0, 1, 0, 1, 0]])
    return batches


def test_batch_proposals_equal_the_per_request_rule() -> None:
    for batch in _random_and_adversarial_batches():
        for min_n, max_n in ((1, 1), (1, 3), (2, 4), (3, 5), (4, 2)):
            ks = [(i % 5) for i in range(len(batch))]
            expected = [ngram_propose(tokens, min_n, max_n, k) for tokens, k in zip(batch, ks, strict=True)]
            assert batch_ngram_propose(batch, min_n, max_n, ks) == expected


def test_drafter_caps_drafts_at_max_model_len_per_request() -> None:
    context = SimpleNamespace(max_model_len=10)
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=4), context)  # type: ignore[arg-type]
    token_ids = [[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 1]]
    out = drafter.propose(DraftInputs(req_ids=["a", "b"], token_ids=token_ids, sampling_params=[]))
    assert out.draft_token_ids == [[3, 1], [2, 1]]


def test_drafter_keeps_each_requests_tokens_across_steps_and_frees_them() -> None:
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), None)  # type: ignore[arg-type]
    rng = np.random.default_rng(2)
    full = [rng.integers(0, 4, size=200).tolist() for _ in range(3)]
    for length in range(2, 200, 7):  # decoding: each step sees a longer prefix
        batch = [tokens[:length] for tokens in full]
        out = drafter.propose(DraftInputs(req_ids=["a", "b", "c"], token_ids=batch, sampling_params=[]))
        assert out.draft_token_ids == [ngram_propose(tokens, 1, 4, 3) for tokens in batch]
    # The same id with other tokens (no finish in between): rebuilt, not appended to.
    out = drafter.propose(DraftInputs(req_ids=["a"], token_ids=[[7, 8, 9, 7, 8]], sampling_params=[]))
    assert out.draft_token_ids == [[9, 7, 8]]
    drafter.finish_requests({"a", "b", "unknown"})
    assert set(drafter.buffers) == {"c"}
