"""Draft verification reads the step's one SamplingBatch: each request's
rows are its draft positions then the bonus position, and row j sees the
request's first j drafts as output tokens."""

from __future__ import annotations

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.worker.draft_verification import verify_drafts
from pagedllm.worker.persistent_batch import CachedRequestState
from pagedllm.worker.rejection_sampler import DraftLayout, rejection_sample
from pagedllm.worker.sampler import Sampler
from pagedllm.worker.sampling_batch import SamplingBatch

VOCAB_SIZE = 8


def _state(req_id: str, params: SamplingParams, output: list[int] | None = None) -> CachedRequestState:
    prompt = [1, 2]
    output = output or []
    return CachedRequestState(req_id, len(prompt), prompt + output, params, None, output_token_ids=list(output))


def _sampling(requests: list[CachedRequestState], drafts: list[list[int]]) -> SamplingBatch:
    num_rows = sum(1 + len(d) for d in drafts)
    return SamplingBatch(
        requests=requests,
        batch_rows=list(range(len(requests))),
        drafts=drafts,
        logits_indices=torch.arange(num_rows),
        grammar_bitmask=None,
        logits_processors=(),
        default_generator=torch.Generator().manual_seed(0),
    )


def _logits(preferred: list[dict[int, float]]) -> torch.Tensor:
    """One row per dict: token -> logit, every other token at 0."""
    logits = torch.zeros(len(preferred), VOCAB_SIZE)
    for row, values in enumerate(preferred):
        for token_id, value in values.items():
            logits[row, token_id] = value
    return logits


def test_greedy_verification_keeps_the_agreed_prefix_and_the_targets_next_token() -> None:
    greedy = SamplingParams(temperature=0.0)
    requests = [_state("a", greedy), _state("b", greedy), _state("c", greedy)]
    drafts = [[3, 5], [], [4]]
    # a: agrees on 3, not on 5 (the target says 6); b: no drafts;
    # c: agrees on 4, then the bonus position says 7.
    logits = _logits([{3: 5.0}, {6: 5.0}, {1: 5.0}, {2: 5.0}, {4: 5.0}, {7: 5.0}])
    sampled = verify_drafts(Sampler(), logits, _sampling(requests, drafts))
    assert sampled.token_ids == [[3, 6], [2], [4, 7]]
    assert sampled.logprobs is None


def test_a_row_sees_the_drafts_before_it_as_output_tokens() -> None:
    # Both of the second row's candidates are close; the presence penalty
    # makes the draft 3 (an output token from that row's view) lose to 5.
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    logits = _logits([{3: 5.0}, {3: 4.0, 5: 3.0}])
    sampled = verify_drafts(Sampler(), logits, _sampling([_state("a", params)], [[3]]))
    assert sampled.token_ids == [[3, 5]]
    # Without the draft before it, the same row keeps 3.
    alone = verify_drafts(Sampler(), logits[1:], _sampling([_state("a", params)], [[]]))
    assert alone.token_ids == [[3]]


def test_logprobs_are_the_targets_raw_distribution_at_each_emitted_token() -> None:
    params = SamplingParams(temperature=0.0, logprobs=1)
    logits = _logits([{3: 5.0}, {6: 5.0}])
    sampled = verify_drafts(Sampler(), logits, _sampling([_state("a", params)], [[3]]))
    assert sampled.token_ids == [[3, 6]]
    assert sampled.logprobs is not None
    raw = logits.log_softmax(dim=-1)
    entries = sampled.logprobs[0]
    assert [entry.token_ids for entry in entries] == [[3, 3], [6, 6]]
    assert [entry.rank for entry in entries] == [1, 1]
    assert entries[0].logprobs[0] == raw[0, 3].item() and entries[1].logprobs[0] == raw[1, 6].item()


def test_an_all_greedy_batch_emits_what_rejection_sampling_emits() -> None:
    """The greedy shortcut against the batched rejection sampler it skips,
    over random draft lengths (empty ones included) that agree with the
    target's argmax for a random prefix."""
    generator = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    for _ in range(50):
        num_requests = int(torch.randint(1, 6, (1,), generator=generator))
        lengths = torch.randint(0, 5, (num_requests,), generator=generator).tolist()
        logits = torch.randn(sum(n + 1 for n in lengths), VOCAB_SIZE, generator=generator)
        argmax = logits.argmax(dim=-1).tolist()
        drafts, row = [], 0
        for n in lengths:
            agree = int(torch.randint(0, n + 1, (1,), generator=generator))
            drafts.append([argmax[row + j] if j < agree else (argmax[row + j] + 1) % VOCAB_SIZE for j in range(n)])
            row += n + 1
        layout = DraftLayout.build(lengths)
        padded = torch.tensor([d + [0] * (max(lengths) - len(d)) for d in drafts], dtype=torch.long)
        expected = rejection_sample(layout, padded, logits, None, torch.ones(num_requests, dtype=torch.bool))
        requests = [_state(str(i), greedy) for i in range(num_requests)]
        sampled = verify_drafts(Sampler(), logits, _sampling(requests, drafts))
        assert sampled.token_ids == [[t for t in r if t >= 0] for r in expected.tolist()]
