from __future__ import annotations

import math

import pytest
import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingMetadata, apply_penalties, compute_prompt_logprobs

# Hand-built distribution over 8 tokens, deliberately not sorted by id.
PROBS = torch.tensor([0.04, 0.30, 0.01, 0.20, 0.08, 0.25, 0.02, 0.10])
LOGITS = PROBS.log()


def _metadata(params: list[SamplingParams], generators: dict[int, torch.Generator] | None = None,
              prompt: list[list[int]] | None = None, output: list[list[int]] | None = None,
              vocab_size: int = 8, eos: list[int | None] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, prompt or [[] for _ in range(n)], output or [[] for _ in range(n)],
                                  generators or {}, vocab_size, "cpu", eos_token_ids=eos)


def _seeded_batch(params: SamplingParams, num_rows: int, first_seed: int) -> tuple[list[SamplingParams], dict]:
    rows = [SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           min_p=params.min_p, seed=first_seed + i) for i in range(num_rows)]
    return rows, {i: torch.Generator().manual_seed(first_seed + i) for i in range(num_rows)}


def _draw_many(params: SamplingParams, logits_row: torch.Tensor, num_rows: int = 250, steps: int = 8) -> torch.Tensor:
    """num_rows * steps draws from one logits row, each row with its own seed."""
    rows, generators = _seeded_batch(params, num_rows, first_seed=1000)
    logits = logits_row.expand(num_rows, -1).clone()
    sampler = Sampler()
    draws = [sampler(logits, _metadata(rows, generators)).sampled_token_ids for _ in range(steps)]
    return torch.cat(draws)


def _frequencies(draws: torch.Tensor, vocab_size: int = 8) -> torch.Tensor:
    return torch.bincount(draws, minlength=vocab_size).float() / draws.numel()


def test_greedy_is_argmax_of_the_logits() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0)] * 5, vocab_size=40))
    assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs_tensors is None


def test_same_seed_same_tokens_whatever_the_batch_and_row_position() -> None:
    vocab_size = 64
    target = torch.randn(vocab_size, generator=torch.Generator().manual_seed(1)) * 0.5
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(batch_logits: torch.Tensor, batch_params: list[SamplingParams], row: int, default_seed: int) -> list[int]:
        torch.manual_seed(default_seed)  # unseeded rows must not disturb seeded ones
        generators = {i: torch.Generator().manual_seed(p.seed) for i, p in enumerate(batch_params)
                      if p.seed is not None and p.temperature > 0}
        sampler = Sampler()
        tokens = []
        for _ in range(30):
            meta = SamplingMetadata.build(batch_params, [[] for _ in batch_params], [[] for _ in batch_params],
                                          generators, vocab_size, "cpu")
            tokens.append(sampler(batch_logits, meta).sampled_token_ids[row].item())
        return tokens

    alone = run(target.unsqueeze(0), [params], 0, default_seed=0)
    others = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(2))
    mixed_logits = torch.cat([others[:2], target.unsqueeze(0), others[2:]])
    mixed_params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), params,
                    SamplingParams(temperature=0.5, seed=99, top_k=5), SamplingParams(temperature=1.2)]
    assert run(mixed_logits, mixed_params, 2, default_seed=7) == alone
    last_logits = torch.cat([others, target.unsqueeze(0)])
    last_params = [SamplingParams(temperature=0.3, seed=5)] * 4 + [params]
    assert run(last_logits, last_params, 4, default_seed=8) == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321)
    assert run(target.unsqueeze(0), [other_seed], 0, default_seed=0) != alone
    assert len(set(alone)) > 5  # a real random stream, not a constant


def test_top_k_never_emits_outside_the_k_most_likely() -> None:
    draws = _draw_many(SamplingParams(top_k=3), LOGITS)
    assert set(draws.tolist()) == {1, 3, 5}
    # Renormalized probabilities 0.30/0.75, 0.20/0.75, 0.25/0.75.
    freq = _frequencies(draws)
    assert torch.allclose(freq[[1, 3, 5]], torch.tensor([0.4, 0.2667, 0.3333]), atol=0.05)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Sorted: 0.30, 0.25, 0.20 -> cumulative 0.55, 0.75; p=0.7 needs three tokens.
    assert set(_draw_many(SamplingParams(top_p=0.7), LOGITS).tolist()) == {1, 3, 5}
    # p=0.5 is reached by two tokens (0.55).
    assert set(_draw_many(SamplingParams(top_p=0.5), LOGITS).tolist()) == {1, 5}
    assert set(_draw_many(SamplingParams(top_p=0.01), LOGITS, steps=2).tolist()) == {1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    # Threshold 0.3 * 0.30 = 0.09: keeps 0.30, 0.25, 0.20, 0.10.
    assert set(_draw_many(SamplingParams(min_p=0.3), LOGITS).tolist()) == {1, 3, 5, 7}


def test_top_k_and_top_p_combine_on_the_renormalized_top_k() -> None:
    # Top-4 renormalized: 0.30, 0.25, 0.20, 0.10 over 0.85 -> cumulative 0.353, 0.647; p=0.6 needs two.
    assert set(_draw_many(SamplingParams(top_k=4, top_p=0.6), LOGITS).tolist()) == {1, 5}


def test_temperature_sharpens_the_distribution() -> None:
    draws = _draw_many(SamplingParams(temperature=0.5), LOGITS, num_rows=500)
    expected = torch.softmax(LOGITS / 0.5, dim=-1)  # p**2 renormalized
    assert torch.allclose(_frequencies(draws), expected, atol=0.03)


def test_greedy_and_random_rows_mixed_in_one_batch() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2, seed=1)] * 3
    generators = {i: torch.Generator().manual_seed(1) for i in (1, 3, 5)}
    sampler = Sampler()
    top2 = logits.topk(2, dim=-1).indices
    for _ in range(20):
        out = sampler(logits, _metadata(params, generators, vocab_size=30)).sampled_token_ids
        assert out[0::2].tolist() == logits[0::2].argmax(dim=-1).tolist()
        for row in (1, 3, 5):
            assert out[row].item() in top2[row].tolist()


def test_penalties_change_logits_as_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0],
                           [2.0, -1.0, 0.5, -0.5, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    meta = _metadata(params, prompt=[[0, 3], [0, 3]], output=[[2, 2, 4], [2, 2, 4]], vocab_size=5)
    out = apply_penalties(logits, meta)
    # Row 0: seen = {0, 2, 3, 4}; repetition divides positives and multiplies negatives by 2;
    # output counts {2: 2, 4: 1}: token 2 -> 0.25 - 2 * 0.5 - 0.25, token 4 -> 0.5 - 0.5 - 0.25.
    assert out[0].tolist() == [1.0, -1.0, -1.0, -1.0, -0.25]
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0, 0].item() == 2.0  # the caller's logits are not modified


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    meta = _metadata([SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)],
                     prompt=[[0, 0]], output=[[1]], vocab_size=3)
    assert apply_penalties(logits, meta).tolist() == [[1.0, -1.0, 1.0]]


def test_presence_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    meta = _metadata([SamplingParams(temperature=0.0, presence_penalty=0.5)], output=[[0]], vocab_size=3)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1]


def test_logprobs_are_raw_topk_with_sampled_token_first() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    second = logits[0].topk(2).indices[1].item()
    top = logits[0].argmax().item()
    params = [SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0, repetition_penalty=1e6),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=0, logprobs=5)]
    meta = _metadata(params, {2: torch.Generator().manual_seed(0)}, output=[[top], [], []], vocab_size=30)
    out = Sampler()(logits, meta)
    lp = out.logprobs_tensors
    assert lp is not None
    ref = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert sampled[0].item() == second  # the penalty moved the choice off the raw argmax
    assert lp.logprob_token_ids.shape == (3, 6) and lp.logprobs.shape == (3, 6)
    assert lp.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    assert torch.equal(lp.logprobs[:, 0], ref.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top5 = ref.topk(5, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top5.indices)
    assert torch.equal(lp.logprobs[:, 1:], top5.values)
    expected_ranks = [int((ref[i] > ref[i, sampled[i]]).sum()) + 1 for i in range(3)]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    assert lp.selected_token_ranks[0].item() == 2 and lp.selected_token_ranks[1].item() == 1


def test_zero_logprobs_returns_only_the_sampled_token() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0, logprobs=0)] * 2, vocab_size=10))
    assert out.logprobs_tensors is not None
    assert out.logprobs_tensors.logprobs.shape == (2, 1)
    assert out.logprobs_tensors.selected_token_ranks.tolist() == [1, 1]


def test_prompt_logprobs_of_the_actual_next_tokens() -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(6))
    targets = torch.tensor([3, 0, 11, 7])
    lp = compute_prompt_logprobs(logits, targets, num_logprobs=3)
    ref = torch.log_softmax(logits, dim=-1)
    assert lp.logprob_token_ids[:, 0].tolist() == [3, 0, 11, 7]
    assert torch.equal(lp.logprobs[:, 0], ref[torch.arange(4), targets])
    assert torch.equal(lp.logprob_token_ids[:, 1:], ref.topk(3, dim=-1).indices)
    sorted_ids = ref.argsort(dim=-1, descending=True).tolist()
    assert lp.selected_token_ranks.tolist() == [sorted_ids[i].index(t) + 1 for i, t in enumerate(targets.tolist())]


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]
    meta = _metadata(params, output=[[2], [2, 2], []], vocab_size=4, eos=[0, 0, 0])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [2, 0, 0]


def test_seeded_row_without_generator_is_rejected() -> None:
    with pytest.raises(ValueError, match="row 0"):
        _metadata([SamplingParams(seed=3)])


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 8), _metadata([]))
    assert out.sampled_token_ids.shape == (0,)


def test_penalty_counts_ignore_out_of_vocab_ids() -> None:
    meta = _metadata([SamplingParams(frequency_penalty=1.0)], output=[[1, 9, -1, 1]], vocab_size=3)
    assert meta.output_token_counts is not None
    assert meta.output_token_counts.tolist() == [[0.0, 2.0, 0.0]]
    assert not math.isnan(apply_penalties(torch.zeros(1, 3), meta).sum().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_picks_argmax_s_index_on_ties_nan_and_inf(dtype: torch.dtype) -> None:
    from pagedllm.worker.sampler import argmax_rows

    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (64, 500), generator=generator).to(dtype)  # every row full of ties
    x[1, 7], x[2, 9], x[2, 3] = float("nan"), float("inf"), float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[1] == 7 and argmax_rows(x)[2] == 3
