"""The rejection sampler with exact vectors, and its distribution by sampling."""

from __future__ import annotations

import torch

from pagedllm.worker.rejection_sampler import PLACEHOLDER_TOKEN_ID as PAD
from pagedllm.worker.rejection_sampler import DraftLayout, rejection_sample

VOCAB = 8


def _one_hot_logits(token_ids: list[int]) -> torch.Tensor:
    """Rows whose argmax is the given token."""
    logits = torch.zeros(len(token_ids), VOCAB)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 10.0
    return logits


def _greedy(drafts: list[list[int]], target_argmax_rows: list[list[int]]) -> list[list[int]]:
    layout = DraftLayout.build([len(d) for d in drafts])
    max_k = max(len(d) for d in drafts)
    draft_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in drafts], dtype=torch.long).reshape(len(drafts), max_k)
    logits = _one_hot_logits([t for rows in target_argmax_rows for t in rows])
    out = rejection_sample(layout, draft_ids, logits, None, torch.ones(len(drafts), dtype=torch.bool))
    return out.tolist()


def test_all_drafts_accepted_emit_a_bonus_token() -> None:
    assert _greedy([[1, 2, 3]], [[1, 2, 3, 7]]) == [[1, 2, 3, 7]]


def test_mismatch_at_first_position_emits_the_target_token_and_nothing_after() -> None:
    assert _greedy([[1, 2, 3]], [[5, 2, 3, 7]]) == [[5, PAD, PAD, PAD]]


def test_mismatch_in_the_middle_keeps_the_accepted_prefix() -> None:
    assert _greedy([[1, 2, 3]], [[1, 4, 3, 7]]) == [[1, 4, PAD, PAD]]


def test_requests_with_different_draft_lengths_and_an_empty_draft() -> None:
    drafts = [[1, 2], [], [3, 4, 5], [6]]
    targets = [[1, 2, 0], [4], [3, 1, 5, 6], [2, 3]]
    assert _greedy(drafts, targets) == [
        [1, 2, 0, PAD],  # all accepted + bonus
        [4, PAD, PAD, PAD],  # empty draft: the bonus only
        [3, 1, PAD, PAD],  # rejected at position 2
        [2, PAD, PAD, PAD],  # rejected at position 1
    ]


def test_random_rows_with_p_equal_to_one_hot_draft_accept_everything() -> None:
    # p puts all mass on the drafts: acceptance is certain, the bonus follows p.
    layout = DraftLayout.build([2])
    probs = torch.zeros(3, VOCAB)
    probs[0, 1] = probs[1, 2] = probs[2, 3] = 1.0
    out = rejection_sample(
        layout, torch.tensor([[1, 2]]), probs.log(), probs, torch.tensor([False]),
        generators={0: torch.Generator().manual_seed(0)},
    )
    assert out.tolist() == [[1, 2, 3]]


def _empirical_first_and_all(p: torch.Tensor, q: torch.Tensor | None, k: int, num_samples: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q_draw = q if q is not None else p
    drafts = torch.multinomial(q_draw.expand(num_samples, VOCAB), k, replacement=True, generator=generator)
    if q is None:  # one-hot q: a deterministic draft token 0 at every position
        drafts = torch.zeros(num_samples, k, dtype=torch.long)
    layout = DraftLayout.build(torch.full((num_samples,), k))
    num_rows = num_samples * (k + 1)
    target_probs = p.expand(num_rows, VOCAB)
    draft_probs = None if q is None else q.expand(num_rows, VOCAB)
    out = rejection_sample(
        layout, drafts, target_probs.log(), target_probs, torch.zeros(num_samples, dtype=torch.bool),
        draft_probs=draft_probs, default_generator=generator,
    )
    first = torch.bincount(out[:, 0], minlength=VOCAB).float() / num_samples
    emitted = out[out != PAD]
    pooled = torch.bincount(emitted, minlength=VOCAB).float() / emitted.numel()
    return first, pooled


def test_emitted_tokens_follow_the_target_distribution() -> None:
    p = torch.tensor([0.30, 0.05, 0.20, 0.10, 0.15, 0.05, 0.10, 0.05])
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.05, 0.15, 0.05, 0.10])
    for k in (1, 3):
        for draft_q in (q, None):
            first, pooled = _empirical_first_and_all(p, draft_q, k, 200_000, seed=k)
            assert 0.5 * (first - p).abs().sum() <= 0.01, (k, draft_q, first)
            assert 0.5 * (pooled - p).abs().sum() <= 0.01, (k, draft_q, pooled)


def test_a_seeded_request_does_not_depend_on_the_rest_of_the_batch() -> None:
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)), 0)

    def run(batch_size: int) -> list[int]:
        layout = DraftLayout.build([2] * batch_size)
        probs = p.expand(3 * batch_size, VOCAB)
        out = rejection_sample(
            layout, torch.tensor([[1, 2]] * batch_size), probs.log(), probs,
            torch.zeros(batch_size, dtype=torch.bool),
            generators={0: torch.Generator().manual_seed(7)},
            default_generator=torch.Generator().manual_seed(batch_size),
        )
        return out[0].tolist()

    assert run(1) == run(5)
