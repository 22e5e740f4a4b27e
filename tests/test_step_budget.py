"""Latency-bounded steps: the step cost model's fit (core/step_cost.py) and
the prompt share it gives each step beside the running decodes
(core/step_budget.py, core/scheduler.py).

Budgets are checked against hand-computed values: with coefficients c
(seconds per unit of step, mixed, token, request, attention), a step of D
decodes and one prompt chunk of P tokens is predicted to take
    c.step + c.mixed + c.token (D + P) + c.request (D + 1) + c.attention pairs / 1024,
and the chunk is the largest P whose step stays within the target.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.scheduler_utils import FakeRunner, make_request, make_scheduler, prompt
from prometheus_client import CollectorRegistry

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.stats import StepCostStats
from pagedllm.core.step_budget import prompt_tokens_within
from pagedllm.core.step_cost import TERMS, StepCostModel, StepShape, attention_pairs
from pagedllm.stat_loggers.step_cost_metrics import StepCostMetrics

# step, mixed, token, request, attention (per 1024 pairs)
TRUTH = (0.010, 0.005, 1e-4, 5.5e-4, 2e-5)


def true_seconds(shape: StepShape, coefficients: tuple[float, ...] = TRUTH) -> float:
    return sum(c * x for c, x in zip(coefficients, shape.features(), strict=True))


def random_shapes(count: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for index in range(count):
        num_reqs = rng.randint(1, 32)
        mixed = index % 3 == 0
        num_tokens = num_reqs + (rng.randint(1, 500) if mixed else 0)
        shapes.append(StepShape(num_tokens, num_reqs, mixed, rng.uniform(0, 200_000)))
    return shapes


def test_the_fit_recovers_the_coefficients_of_noise_free_steps() -> None:
    model = StepCostModel()
    for shape in random_shapes(60):
        model.observe(shape, true_seconds(shape))
    model.refit()
    assert model.named_coefficients() == pytest.approx(dict(zip(TERMS, TRUTH, strict=True)), rel=1e-6)
    shape = StepShape(40, 8, True, 5000.0)
    assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=1e-6)


def test_a_term_that_fits_below_zero_is_dropped_and_the_rest_refitted() -> None:
    # Time falls with the request count: no physical cost does that, so the
    # term is fixed at 0 and the others are the plain least squares without it.
    truth = (0.010, 0.005, 1e-4, -2e-4, 2e-5)
    shapes = random_shapes(40, seed=1)
    forgetting = 0.99
    model = StepCostModel(forgetting=forgetting, ridge=0.0)
    for shape in shapes:
        model.observe(shape, true_seconds(shape, truth))
    model.refit()
    x = np.array([shape.features() for shape in shapes])
    y = np.array([true_seconds(shape, truth) for shape in shapes])
    # Each step weighs forgetting^age / seconds^2 (least squares on the relative error).
    weights = np.array([forgetting ** (len(shapes) - 1 - i) for i in range(len(shapes))]) / y**2
    keep = [0, 1, 2, 4]
    reference, *_ = np.linalg.lstsq(x[:, keep] * np.sqrt(weights)[:, None], y * np.sqrt(weights), rcond=None)
    assert model.coefficients is not None
    assert model.coefficients[3] == 0.0
    assert [model.coefficients[i] for i in keep] == pytest.approx(list(reference), rel=1e-6, abs=1e-12)


def test_no_prediction_before_enough_steps_of_each_kind() -> None:
    model = StepCostModel(refit_every=1, min_samples=4)
    decode = StepShape(8, 8, False, 100.0)
    for _ in range(10):
        model.observe(decode, true_seconds(decode))
    assert model.predict(decode) is None  # no mixed step seen yet
    mixed = StepShape(108, 9, True, 9000.0)
    for _ in range(3):
        model.observe(mixed, true_seconds(mixed))
    assert model.predict(decode) is None
    model.observe(mixed, true_seconds(mixed))
    assert model.predict(decode) is not None
    # A step with no time measured (0.0) is not a sample.
    model.observe(mixed, 0.0)
    assert model.num_samples == 14


def test_attention_pairs_of_a_chunk() -> None:
    # 3 new tokens after 10 cached read 11 + 12 + 13 keys.
    assert attention_pairs(3, 10) == 36
    assert attention_pairs(1, 20) == 21


def test_prompt_tokens_within_linear_and_quadratic_costs() -> None:
    coefficients = dict(zip(TERMS, (0.0, 0.0, 1e-4, 0.0, 0.0), strict=True))
    assert prompt_tokens_within(0.01005, coefficients) == 100  # 100.5 tokens' time
    assert prompt_tokens_within(-0.001, coefficients) == 0
    # attention 2.048e-4 s per 1024 pairs: P tokens cost 1e-4 P + 1e-7 P (P + 1).
    coefficients["attention"] = 2.048e-4
    tokens = prompt_tokens_within(0.01, coefficients)
    assert tokens == 91

    def cost(p: int) -> float:
        return 1e-4 * p + 1e-7 * p * (p + 1)

    assert cost(91) <= 0.01 < cost(92)


def fitted_scheduler(coefficients: tuple[float, ...], **kwargs: object):
    scheduler = make_scheduler(num_blocks=512, block_size=16, max_model_len=4096, **kwargs)
    scheduler.step_budget.cost_model.coefficients = coefficients
    return scheduler


def start_decodes(scheduler, runner: FakeRunner, names: str = "ABCD") -> None:
    for index, name in enumerate(names):
        scheduler.add_request(make_request(name, prompt(100 * (index + 1), 8), max_tokens=100))
    runner.step()  # their prompts: no decode runs yet, so the whole budget


@pytest.mark.parametrize(
    ("step_s", "max_step_latency_ms", "expected_chunk"),
    [
        # auto, 50 ms floor: decodes alone 0.01 + 4e-4 + 4 x 5.5e-4 = 12.6 ms (x3 < 50 ms);
        # with the chunk's request and eager step 18.15 ms: 31.85 ms = 318.5 tokens left.
        (0.010, None, 318),
        # auto, 3x the decodes: 0.03 + 0.0004 + 0.0022 = 32.6 ms -> 97.8 ms target;
        # 97.8 - 38.15 = 59.65 ms = 596.5 tokens.
        (0.030, None, 596),
        # explicit 23.2 ms: 23.2 - 18.15 = 5.05 ms = 50.5 tokens.
        (0.010, 23.2, 50),
        # a target below the decodes' own step: prompts still progress, at
        # least 32 tokens and the 600 waiting ones over 16 steps (37.5).
        (0.010, 5.0, 38),
    ],
)
def test_a_prompt_gets_the_tokens_that_fit_beside_the_decodes(
    step_s: float, max_step_latency_ms: float | None, expected_chunk: int
) -> None:
    scheduler = fitted_scheduler((step_s, 0.005, 1e-4, 5.5e-4, 0.0), max_step_latency_ms=max_step_latency_ms)
    runner = FakeRunner(scheduler)
    start_decodes(scheduler, runner)
    scheduler.add_request(make_request("E", prompt(5000, 600), max_tokens=4))
    step = runner.step()
    assert step.scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "E": expected_chunk}
    if 38 < expected_chunk <= 300:  # the running chunk is bounded the same way next step
        assert runner.step().scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "E": expected_chunk}


def test_waiting_prompt_tokens_drain_within_sixteen_steps() -> None:
    # 5.05 ms = 50 tokens by the target (above), but 1,000 + 2,000 prompt
    # tokens wait: at least 3,000 / 16 = 187.5 -> 188 go in this step. E
    # takes them; next step E's 812 left and F's 2,000 wait: 2,812 / 16 -> 176.
    scheduler = fitted_scheduler((0.010, 0.005, 1e-4, 5.5e-4, 0.0), max_step_latency_ms=23.2)
    runner = FakeRunner(scheduler)
    start_decodes(scheduler, runner)
    scheduler.add_request(make_request("E", prompt(5000, 1000), max_tokens=4))
    scheduler.add_request(make_request("F", prompt(9000, 2000), max_tokens=4))
    assert runner.step().scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "E": 188}
    assert runner.step().scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "E": 176}


def test_without_running_decodes_a_prompt_gets_the_whole_budget() -> None:
    scheduler = fitted_scheduler((0.010, 0.005, 1e-4, 5.5e-4, 0.0))
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("E", prompt(5000, 3000), max_tokens=4))
    assert runner.step().scheduled == {"E": 2048}


def test_a_chunk_ahead_of_the_decodes_never_takes_their_tokens() -> None:
    # E's first chunk (threshold 100) is scheduled with A-D's prompts, so E
    # runs ahead of them in the running order. Then, without the threshold
    # and with time to spare (1 s target), E gets the 132-token budget less
    # the decodes' 4, not all of it.
    scheduler = fitted_scheduler(
        (0.010, 0.005, 1e-4, 5.5e-4, 0.0), max_step_latency_ms=1000.0, max_num_batched_tokens=132,
        long_prefill_token_threshold=100,
    )
    scheduler.step_budget.cost_model.coefficients = None  # unfitted for the first step
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("E", prompt(5000, 3000), max_tokens=4))
    start_decodes(scheduler, runner)
    assert [request.request_id for request in scheduler.running] == ["E", "A", "B", "C", "D"]
    scheduler.long_prefill_token_threshold = 0
    scheduler.step_budget.cost_model.coefficients = (0.010, 0.005, 1e-4, 5.5e-4, 0.0)
    assert runner.step().scheduled == {"E": 128, "A": 1, "B": 1, "C": 1, "D": 1}


def test_priority_order_between_waiting_prompts_is_unchanged() -> None:
    # 31.85 ms of prompt time per step (first case above): the higher
    # priority (lower value) prompt takes 300 tokens' 30 ms first; the other
    # gets the rest less its request's 0.55 ms: 1.3 ms = 13 tokens.
    scheduler = fitted_scheduler((0.010, 0.005, 1e-4, 5.5e-4, 0.0), scheduling_policy="priority")
    runner = FakeRunner(scheduler)
    start_decodes(scheduler, runner)
    scheduler.add_request(make_request("low", prompt(5000, 300), priority=5, max_tokens=4))
    scheduler.add_request(make_request("high", prompt(6000, 300), priority=0, max_tokens=4))
    step = runner.step()
    assert step.scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "high": 300, "low": 13}


@pytest.mark.parametrize("kwargs", [{"max_step_latency_ms": 0.0}, {"enable_chunked_prefill": False}])
def test_latency_bound_off(kwargs: dict) -> None:
    scheduler = make_scheduler(num_blocks=512, block_size=16, max_model_len=2048, **kwargs)
    assert scheduler.step_budget is None
    runner = FakeRunner(scheduler)
    start_decodes(scheduler, runner)
    scheduler.add_request(make_request("E", prompt(5000, 1500), max_tokens=4))
    assert runner.step().scheduled == {"A": 1, "B": 1, "C": 1, "D": 1, "E": 1500}
    assert runner.step().scheduler_output.step_shape is None


def test_each_step_is_measured_with_its_shape() -> None:
    scheduler = make_scheduler(num_blocks=512, block_size=16, max_model_len=4096)
    seen: list[SchedulerOutput] = []

    def step_seconds(scheduler_output: SchedulerOutput) -> float:
        seen.append(scheduler_output)
        return 0.02

    runner = FakeRunner(scheduler, step_seconds=step_seconds)
    start_decodes(scheduler, runner, "AB")
    scheduler.add_request(make_request("E", prompt(5000, 10), max_tokens=4))
    runner.step()
    # A and B decode their first token after 8 cached (8 + 1 keys each); E's
    # 10 tokens read 1 + 2 + ... + 10 = 55 keys.
    assert seen[-1].step_shape == StepShape(12, 3, True, 9 + 9 + 55)
    assert seen[0].step_shape == StepShape(16, 2, True, 2 * attention_pairs(8, 0))
    assert scheduler.step_budget.cost_model.num_samples == 2
    stats = scheduler.make_stats().step_cost_stats
    assert stats is not None and stats.num_samples == 2 and stats.coefficients == {}


def test_the_scheduler_fits_the_platforms_step_times_and_bounds_by_them() -> None:
    scheduler = make_scheduler(num_blocks=1024, block_size=16, max_model_len=4096)
    runner = FakeRunner(scheduler, step_seconds=lambda output: true_seconds(output.step_shape))
    rng = random.Random(0)
    for index in range(40):  # staggered arrivals: decode-only and mixed steps
        if index % 3 == 0:
            scheduler.add_request(make_request(f"r{index}", prompt(10_000 + 500 * index, rng.randint(20, 400)),
                                               max_tokens=rng.randint(5, 30)))
        runner.step()
    cost_model = scheduler.step_budget.cost_model
    assert cost_model.num_mixed_samples >= 8 and cost_model.num_samples - cost_model.num_mixed_samples >= 8
    cost_model.refit()
    assert cost_model.named_coefficients() == pytest.approx(dict(zip(TERMS, TRUTH, strict=True)), rel=1e-5)
    # A long prompt now gets the largest chunk whose predicted step fits the target.
    while scheduler.running and scheduler.running[0].num_computed_tokens < scheduler.running[0].num_tokens - 1:
        runner.step()  # until every running request decodes
    decodes = scheduler._decode_load()[0]
    assert decodes.num_reqs == len(scheduler.running) > 0
    scheduler.add_request(make_request("long", prompt(50_000, 3000), max_tokens=4))
    chunk = runner.step().scheduled["long"]
    target = max(0.05, 3 * true_seconds(decodes))

    def step_with_chunk(p: int) -> float:
        return true_seconds(StepShape(decodes.num_tokens + p, decodes.num_reqs + 1, True,
                                      decodes.attention_pairs + attention_pairs(p, 0)))

    assert step_with_chunk(chunk) <= target * (1 + 1e-9) < step_with_chunk(chunk + 1)


def test_step_cost_metrics_expose_the_fit() -> None:
    registry = CollectorRegistry()
    metrics = StepCostMetrics(registry, "m")
    metrics.record(StepCostStats(dict(zip(TERMS, TRUTH, strict=True)), 120, 0.04, 0.05, 318))
    value = registry.get_sample_value
    assert value("pagedllm:step_cost_coefficient_seconds", {"model_name": "m", "term": "token"}) == 1e-4
    assert value("pagedllm:step_cost_fit_samples", {"model_name": "m"}) == 120
    assert value("pagedllm:step_cost_fit_relative_error", {"model_name": "m"}) == 0.04
    assert value("pagedllm:step_latency_target_seconds", {"model_name": "m"}) == 0.05
    assert value("pagedllm:step_prefill_token_budget", {"model_name": "m"}) == 318


def test_a_chunk_after_more_cached_tokens_gets_fewer_tokens() -> None:
    # Attention 1e-7 s per (query, key) pair: E's second chunk reads its first
    # chunk's keys too. Reference: the largest chunk whose predicted step
    # (found by scanning) stays within the 40 ms target.
    coefficients = (0.010, 0.005, 1e-4, 5.5e-4, 1.024e-4)
    scheduler = fitted_scheduler(coefficients, max_step_latency_ms=40.0)
    runner = FakeRunner(scheduler)
    start_decodes(scheduler, runner)
    scheduler.add_request(make_request("E", prompt(5000, 2000), max_tokens=4))

    def largest_chunk(num_cached: int) -> int:
        decodes = scheduler._decode_load()[0]

        def step_s(p: int) -> float:
            return true_seconds(StepShape(decodes.num_tokens + p, decodes.num_reqs + 1, True,
                                          decodes.attention_pairs + attention_pairs(p, num_cached)), coefficients)

        return max(p for p in range(1, 2000) if step_s(p) <= 0.040)

    first = largest_chunk(0)
    assert runner.step().scheduled["E"] == first
    second = largest_chunk(first)
    assert runner.step().scheduled["E"] == second
    assert second < first
