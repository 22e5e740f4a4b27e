"""Latency-bounded steps on the real engine (the shipped tiny model): the
step cost model fits the runner's measured step times, prompts are split
into the chunks the bound allows while others decode, and no request's
greedy tokens change (core/step_budget.py)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.step_cost import TERMS

NUM_REQUESTS = 14
CONCURRENCY = 4


def closed_loop(max_step_latency_ms: float) -> tuple[dict[str, list[int]], set[str], int, object]:
    """Four requests at a time, a new one whenever one finishes: each
    request's tokens, the requests whose prompt ran in several chunks, the
    steps that computed tokens, and the engine core's scheduler."""
    torch.set_num_threads(1)
    llm = LLM(model="tiny", dtype="float32", enable_prefix_caching=False, max_step_latency_ms=max_step_latency_ms)
    core = llm.engine_core.engine_core
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(rng.randint(60, 160))] for _ in range(NUM_REQUESTS)]
    # Different lengths, so that requests finish (and new ones arrive) while others decode.
    max_tokens = [rng.randint(4, 20) for _ in range(NUM_REQUESTS)]
    tokens: dict[str, list[int]] = {}
    split: set[str] = set()
    added = num_steps = 0

    def add() -> None:
        nonlocal added
        params = SamplingParams(max_tokens=max_tokens[added], temperature=0.0, ignore_eos=True)
        core.add_request(Request(f"r{added}", prompts[added], params, None))
        added += 1

    for _ in range(CONCURRENCY):
        add()
    schedule = core.scheduler.schedule

    def recording_schedule():
        nonlocal num_steps
        output = schedule()
        num_steps += output.total_num_scheduled_tokens > 0
        for new_request in output.scheduled_new_reqs:
            if output.num_scheduled_tokens[new_request.req_id] < len(new_request.prompt_token_ids):
                split.add(new_request.req_id)
        return output

    core.scheduler.schedule = recording_schedule
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None and added < NUM_REQUESTS:
                add()
    scheduler = core.scheduler
    llm.shutdown()
    return tokens, split, num_steps, scheduler


@pytest.mark.slow
def test_bounded_steps_split_prompts_and_keep_every_greedy_token() -> None:
    plain_tokens, plain_split, _, plain_scheduler = closed_loop(0.0)
    assert plain_scheduler.step_budget is None
    assert plain_split == set()  # the 2,048-token budget takes every prompt whole
    # A 0.5 ms target: once the model is fitted, prompts beside decodes get
    # the floor (32 tokens, or a 32nd of those waiting) and run in chunks.
    bounded_tokens, bounded_split, num_steps, scheduler = closed_loop(0.5)
    assert bounded_tokens == plain_tokens
    assert len(bounded_tokens) == NUM_REQUESTS
    assert len(bounded_split) >= 3
    cost_model = scheduler.step_budget.cost_model
    assert cost_model.fitted and set(cost_model.named_coefficients()) == set(TERMS)
    assert all(value >= 0.0 for value in cost_model.named_coefficients().values())
    assert cost_model.num_samples == num_steps  # every step that ran is a sample
    stats = scheduler.make_stats().step_cost_stats
    assert stats is not None and stats.target_s == 0.0005 and stats.prefill_budget >= 32
