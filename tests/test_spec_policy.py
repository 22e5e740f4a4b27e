"""The speculation-policy kind: how many tokens each request drafts per step.

The adaptive policy's decisions are checked against hand-computed numbers
(expected tokens of a k-draft at acceptance a: (1 - a^(k+1)) / (1 - a),
against a verify step's measured cost over a plain step's); vLLM's
disable_by_batch_size is a policy; and whatever a policy decides, greedy
output is the one without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig, SpeculativeConfig
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.spec_decode.adaptive_policy import (
    MAX_PROBE_BACKOFF,
    PROBE_INTERVAL,
    AdaptivePolicy,
    best_num_drafts,
    expected_tokens,
)
from pagedllm.spec_decode.measurements import SpecMeasurements, batch_bucket
from pagedllm.spec_decode.policy import AlwaysPolicy, BatchSizePolicy, SpeculationPolicy
from pagedllm.testing.suites.drafter import repeated_span_prompts

K = 3


def _measured(batch_size: int, plain_s: float, verify_s: float, rest_s: float = 0.0) -> SpecMeasurements:
    # Each request's acceptance from its own verifications (no drafter-wide prior).
    measurements = SpecMeasurements(drafter_prior=False)
    measurements.observe_step(batch_size, verified=False, step_s=plain_s, rest_s=rest_s)
    measurements.observe_step(batch_size, verified=True, step_s=verify_s, rest_s=rest_s)
    return measurements


def _config(**kwargs: Any) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=K, **kwargs)


def test_expected_tokens_of_a_draft() -> None:
    assert expected_tokens(0.9, 3) == pytest.approx(3.439)  # 1 + .9 + .81 + .729
    assert expected_tokens(0.1, 3) == pytest.approx(1.111)
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_high_acceptance_and_cheap_drafts_draft_k() -> None:
    # plain 10 ms, verify 15 ms: r = 1.5; a k-draft costs 1 + 0.5 k / 3 plain steps.
    # a = 0.9: k=1 1.9/1.167 = 1.63, k=2 2.71/1.333 = 2.03, k=3 3.439/1.5 = 2.29 -> 3
    measurements = _measured(1, plain_s=0.010, verify_s=0.015)
    measurements.observe_acceptance("a", num_proposed=10, num_accepted=9)
    assert AdaptivePolicy(_config()).num_drafts(["a"], measurements) == [3]


def test_low_acceptance_drafts_nothing() -> None:
    # a = 0.1: k=1 1.1/1.167 = 0.94, k=2 1.11/1.333, k=3 1.111/1.5: none beats a plain step -> 0
    assert best_num_drafts(0.1, 1.5, K) == 0
    # a = 0 (the first draft rejected): 1 token per step whatever k
    measurements = _measured(1, plain_s=0.010, verify_s=0.015)
    measurements.observe_acceptance("a", num_proposed=10, num_accepted=0)
    assert measurements.acceptance("a") == 0.0
    assert AdaptivePolicy(_config()).num_drafts(["a"], measurements) == [0]


def test_middling_acceptance_and_dear_drafts_draft_fewer() -> None:
    # r = 2 (rest counts for both): k=1 1.5/1.333 = 1.125, k=2 1.75/1.667 = 1.05, k=3 1.875/2 -> 1
    assert best_num_drafts(0.5, 2.0, K) == 1
    measurements = _measured(2, plain_s=0.008, verify_s=0.018, rest_s=0.002)
    measurements.observe_acceptance("a", 2, 1)
    measurements.observe_acceptance("b", 3, 3)
    assert AdaptivePolicy(_config()).num_drafts(["a", "b"], measurements) == [1, 3]


def test_a_batch_drafts_only_if_its_mean_gain_pays_for_the_verify_step() -> None:
    # r = 3 at batch 4. "a" alone (a = .95): k=3 gives 3.71 / 3 = 1.24 -> 3 per request;
    # but any draft makes the whole step a verify step: (3.71 + 3 x 1) / 4 = 1.68 < 1.05 x 3 -> 0
    measurements = _measured(4, plain_s=0.010, verify_s=0.030)
    measurements.observe_acceptance("a", 20, 19)
    for req_id in "bcd":
        measurements.observe_acceptance(req_id, 10, 1)
    assert AdaptivePolicy(_config()).num_drafts(list("abcd"), measurements) == [0] * 4
    # a request never verified probes: the step verifies anyway, so "a" drafts too
    policy = AdaptivePolicy(_config())
    assert policy.num_drafts(list("abcn"), measurements) == [3, 0, 0, 3]
    # but a batch probes at most once per PROBE_INTERVAL steps: "n" waits, drafting nothing
    for _ in range(PROBE_INTERVAL):
        assert policy.num_drafts(list("abcn"), measurements) == [0] * 4
    assert policy.num_drafts(list("abcn"), measurements) == [3, 0, 0, 3]
    # unless every request of the batch waits to probe (a new request alone)
    assert policy.num_drafts(["n"], measurements) == [3]


def test_drafts_found_for_few_requests_do_not_pay_for_a_verify_step() -> None:
    # r = 2 at batch 4, a = 0.9 everywhere: 3 drafts give 3.439 tokens.
    measurements = _measured(4, plain_s=0.010, verify_s=0.020)
    for req_id in "abcd":
        measurements.observe_acceptance(req_id, 10, 9)
    policy = AdaptivePolicy(_config())
    assert policy.num_drafts(list("abcd"), measurements) == [3] * 4
    # The drafter found drafts for two of them: (2 x 3.439 + 2) / 4 = 2.22 > 1.05 x 2: verified
    assert policy.keep_drafts(list("abcd"), [3, 3, 0, 0], measurements)
    # For one: (3.439 + 3) / 4 = 1.61 < 2.1: a plain step
    assert not policy.keep_drafts(list("abcd"), [3, 0, 0, 0], measurements)
    # The step verifies as many rows as the longest draft: one draft is charged 1 + (2 - 1) / 3 = 1.33
    assert not policy.keep_drafts(list("abcd"), [1, 0, 0, 0], measurements)  # (1.9 + 3) / 4 = 1.23 < 1.4
    assert policy.keep_drafts(list("abcd"), [1, 1, 1, 0], measurements)  # (3 x 1.9 + 1) / 4 = 1.68
    # A never-verified request that found drafts is a probe: kept; so is one
    # held back PROBE_INTERVAL steps, once the step has granted it its probe
    assert policy.keep_drafts(list("abcn"), [0, 0, 0, 2], measurements)
    for _ in range(PROBE_INTERVAL):
        measurements.observe_drafted("d", 0)
    assert policy.num_drafts(list("abcd"), measurements) == [3] * 4  # "d" probes
    assert policy.keep_drafts(list("abcd"), [0, 0, 0, 3], measurements)
    assert policy.keep_drafts(list("abcd"), [0, 0, 0, 0], measurements)  # nothing to verify either way
    assert AlwaysPolicy(_config()).keep_drafts(list("abcd"), [3, 0, 0, 0], measurements)


def test_each_batch_size_bucket_has_its_own_cost() -> None:
    measurements = _measured(1, plain_s=0.010, verify_s=0.012)  # cheap at batch 1
    measurements.observe_step(8, verified=False, step_s=0.010, rest_s=None)
    measurements.observe_step(8, verified=True, step_s=0.040, rest_s=None)  # r = 4 at batch 5..8
    for req_id in "abcde":
        measurements.observe_acceptance(req_id, 3, 2)  # a = 2/3
    policy = AdaptivePolicy(_config())
    assert policy.num_drafts(["a"], measurements) == [3]
    assert policy.num_drafts(list("abcde"), measurements) == [0] * 5
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]


def test_adaptive_policy_measures_before_it_decides_and_probes_again() -> None:
    policy, measurements = AdaptivePolicy(_config()), SpecMeasurements()
    assert policy.num_drafts(["a"], measurements) == [K]  # no verify step measured yet
    measurements.observe_step(1, verified=True, step_s=0.015, rest_s=0.0)
    assert policy.num_drafts(["a"], measurements) == [0]  # now a plain one
    measurements.observe_step(1, verified=False, step_s=0.010, rest_s=0.0)
    assert policy.num_drafts(["new"], measurements) == [K]  # a request never verified drafts
    measurements.observe_acceptance("a", 10, 0)  # a = 0
    for _ in range(PROBE_INTERVAL):
        assert policy.num_drafts(["a"], measurements) == [0]
        measurements.observe_drafted("a", 0)
    assert policy.num_drafts(["a"], measurements) == [K]  # probes its acceptance again
    measurements.forget("a")
    assert measurements.acceptance("a") is None and measurements.steps_without_drafts("a") == 0


def test_probes_that_change_nothing_come_ever_more_rarely() -> None:
    policy, measurements = AdaptivePolicy(_config()), _measured(1, plain_s=0.010, verify_s=0.015)
    measurements.observe_acceptance("a", 10, 0)  # a = 0: never worth drafting
    waits = []
    for _ in range(MAX_PROBE_BACKOFF + 3):
        steps = 0
        while policy.num_drafts(["a"], measurements) == [0]:
            measurements.observe_drafted("a", 0)
            steps += 1
        measurements.observe_drafted("a", K)  # the probe's drafts, all rejected
        measurements.observe_acceptance("a", K, 0)
        waits.append(steps)
    assert waits == [PROBE_INTERVAL << min(n, MAX_PROBE_BACKOFF) for n in range(MAX_PROBE_BACKOFF + 3)]
    # Once its acceptance pays, it drafts by choice, and its next probe comes at the first interval again.
    measurements.observe_acceptance("a", 10, 10)
    measurements.observe_acceptance("a", 10, 10)
    assert policy.num_drafts(["a"], measurements) == [K]
    measurements.observe_drafted("a", K)
    for _ in range(10):  # then its drafts stop being accepted
        measurements.observe_acceptance("a", K, 0)
    for _ in range(PROBE_INTERVAL):
        assert policy.num_drafts(["a"], measurements) == [0]
        measurements.observe_drafted("a", 0)
    assert policy.num_drafts(["a"], measurements) == [K]


def test_first_probes_that_find_no_draft_are_no_failures() -> None:
    policy, measurements = AdaptivePolicy(_config()), _measured(1, plain_s=0.010, verify_s=0.015)
    for _ in range(5):  # never verified: probes every step, the drafter finds nothing
        assert policy.num_drafts(["a"], measurements) == [K]
        measurements.observe_drafted("a", 0)
    measurements.observe_acceptance("a", 10, 0)
    steps = 0  # the steps without drafts so far count: a first probe's wait, 16 in all
    while policy.num_drafts(["a"], measurements) == [0]:
        measurements.observe_drafted("a", 0)
        steps += 1
    assert steps == PROBE_INTERVAL - 5


def test_one_slow_step_moves_a_cost_by_a_tenth_of_its_average_at_most() -> None:
    measurements = SpecMeasurements()
    measurements.observe_step(4, verified=False, step_s=0.010, rest_s=0.001)
    measurements.observe_step(4, verified=False, step_s=0.100, rest_s=0.001)  # a collection, say
    # counted as 2 x 10 ms: 0.9 * 10 + 0.1 * 20
    assert measurements.step_cost(4).plain_s == pytest.approx(0.011)
    measurements.observe_step(4, verified=False, step_s=0.005, rest_s=0.001)  # faster ones count in full
    assert measurements.step_cost(4).plain_s == pytest.approx(0.9 * 0.011 + 0.1 * 0.005)


def test_a_plain_steps_cost_leaves_out_the_drafter_and_a_verify_steps_has_it() -> None:
    """A model-free drafter's propose in a step that scored no drafts (it
    catching up on every step it was not asked) is no part of what a step
    without speculation costs; a verify step's propose is what drafting
    costs it. A model drafter's is part of both: it mirrors every step."""
    from pagedllm.core.scheduler_output import SpecStepTimes
    from pagedllm.worker.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.spec_measurements = SpecMeasurements()
    runner.graph_runner = runner.drafter = None
    runner._captures_at_start = 0
    runner._last_step_end = None
    sampling = SimpleNamespace(requests=[object(), object()])
    runner._observe_step_cost(2, [[], []], sampling, SpecStepTimes(0.004, 0.030, 2, 2), start=0.0)
    runner._observe_step_cost(8, [[7, 7, 7], [7, 7, 7]], sampling, SpecStepTimes(0.006, 0.002, 2, 2), start=0.0)
    cost = runner.spec_measurements.step_cost(2)
    assert cost.plain_s == pytest.approx(0.004) and cost.verify_s == pytest.approx(0.008)
    runner.spec_measurements = SpecMeasurements()
    runner.drafter = SimpleNamespace(needs_lookahead_slots=True, draft_graphs=None)
    runner._observe_step_cost(2, [[], []], sampling, SpecStepTimes(0.004, 0.003, 2, 2), start=0.0)
    assert runner.spec_measurements.step_cost(2).plain_s == pytest.approx(0.007)


def test_acceptance_is_a_moving_average_per_request() -> None:
    # Per position: 4 of 4 tried accepted, then 0 of 1 (the first rejected).
    # Moving averages (decay 0.5): accepted 0.5 x 4 + 0.5 x 0 = 2, tried 0.5 x 4 + 0.5 x 1 = 2.5.
    measurements = SpecMeasurements(acceptance_decay=0.5)
    measurements.observe_acceptance("a", 4, 4)
    assert measurements.acceptance("a") == 1.0
    measurements.observe_acceptance("a", 4, 0)
    measurements.observe_acceptance("a", 0, 0)  # nothing proposed: nothing learned
    assert measurements.acceptance("a") == pytest.approx(0.8)
    assert measurements.acceptance("c") is None
    first = SpecMeasurements()
    first.observe_acceptance("b", 4, 2)  # 2 accepted, the third rejected: a = 2/3
    assert first.acceptance("b") == pytest.approx(2 / 3)


def test_a_new_requests_acceptance_starts_from_the_drafters_average() -> None:
    # The drafter-wide averages (decay 0.5): accepted 0.5 x 4 + 0.5 x 2 = 3,
    # tried 0.5 x 4 + 0.5 x 3 = 3.5. "b"'s first draft is rejected at once
    # (0 of 1 tried): from that prior, 0.7 x 3 + 0.3 x 0 = 2.1 over
    # 0.7 x 3.5 + 0.3 x 1 = 2.75, a = 0.764, not 0.
    measurements = SpecMeasurements(acceptance_decay=0.7, prior_decay=0.5)
    measurements.observe_acceptance("a", 4, 4)
    measurements.observe_acceptance("a", 4, 2)
    measurements.observe_acceptance("b", 4, 0)
    assert measurements.acceptance("b") == pytest.approx(2.1 / 2.75)
    assert measurements.acceptance("a") == pytest.approx((0.7 * 4 + 0.3 * 2) / (0.7 * 4 + 0.3 * 3))


def test_once_requests_finished_each_weighs_the_same_in_the_prior() -> None:
    """A straggler verified alone many times does not decide what the next
    requests start from: the finished requests' own averages do, one each."""
    measurements = SpecMeasurements(acceptance_decay=0.5, prior_decay=0.5, drafter_prior=True)
    measurements.observe_acceptance("good", 4, 4)  # a = 1: 4 of 4 tried
    for _ in range(30):
        measurements.observe_acceptance("straggler", 4, 0)  # 0 of 1 tried, many times
    measurements.forget("straggler")
    measurements.forget("good")
    # prior: accepted 0.5 * 0 + 0.5 * 4 = 2 (straggler first), tried 0.5 * 1 + 0.5 * 4 = 2.5.
    # "new"'s first verification (3 of 4) from there: (0.5 * 2 + 0.5 * 3) / (0.5 * 2.5 + 0.5 * 4)
    measurements.observe_acceptance("new", 4, 3)
    assert measurements.acceptance("new") == pytest.approx(2.5 / 3.25)


def test_disable_by_batch_size_is_a_policy() -> None:
    measurements = _measured(4, plain_s=0.010, verify_s=0.011)
    for req_id in "abcd":
        measurements.observe_acceptance(req_id, 10, 9)
    batch_size = BatchSizePolicy(_config(disable_by_batch_size=4))
    assert batch_size.num_drafts(list("abc"), measurements) == [K] * 3
    assert batch_size.num_drafts(list("abcd"), measurements) == [0] * 4
    # the adaptive default honours it first: cheap drafts, a = 0.9, still 0 at 4 requests
    assert AdaptivePolicy(_config(disable_by_batch_size=4)).num_drafts(list("abcd"), measurements) == [0] * 4
    assert AdaptivePolicy(_config()).num_drafts(list("abcd"), measurements) == [K] * 4
    assert BatchSizePolicy(_config()).num_drafts(list("abcd"), measurements) == [K] * 4
    assert AlwaysPolicy(_config()).num_drafts(["a"], SpecMeasurements()) == [K]


def test_policy_config_fields_and_vllm_flag_names() -> None:
    config = EngineConfig.from_flat(speculative_policy="batch_size", speculative_disable_by_batch_size=8)
    assert (config.speculative.policy, config.speculative.disable_by_batch_size) == ("batch_size", 8)
    config = EngineConfig.from_flat(speculative_config={"method": "ngram", "disable_by_batch_size": 16})
    assert (config.speculative.policy, config.speculative.disable_by_batch_size) == ("adaptive", 16)


def test_builtin_policies_are_registered_like_plugins() -> None:
    registry = get_plugin_manager().spec_policies
    assert {name: registry.get(name).source for name in ("adaptive", "batch_size", "always")} == dict.fromkeys(
        ("adaptive", "batch_size", "always"), "builtin"
    )
    assert registry.load("adaptive") is AdaptivePolicy


# ------------------------------------------------------------- end to end


class StaggeredPolicy(SpeculationPolicy):
    """Request i of a step drafts i mod (k + 1): 0, 1, .., k, 0, ..."""

    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        return [i % (self.num_speculative_tokens + 1) for i in range(len(req_ids))]


class NeverPolicy(SpeculationPolicy):
    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        return [0] * len(req_ids)


class DropPolicy(AlwaysPolicy):
    """Lets every request draft k, then drops whatever the drafter found."""

    def keep_drafts(self, req_ids: Sequence[str], num_drafts: Sequence[int], measurements: SpecMeasurements) -> bool:
        return False


class PolicyPlugin:
    @hookimpl
    def register_spec_policies(self, register: RegisterFn) -> None:
        register("fixture_staggered", f"{__name__}:StaggeredPolicy")
        register("fixture_never", f"{__name__}:NeverPolicy")
        register("fixture_drop", f"{__name__}:DropPolicy")


@pytest.fixture
def policy_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    name = pm.register(PolicyPlugin(), name="spec-policy-test-plugin")
    yield
    pm.unregister(name=name)


def _generate(policy: str | None, prompts: list[list[int]]) -> tuple[list[list[int]], Any]:
    speculative = None if policy is None else {
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "policy": policy,
    }
    extra = {} if speculative is None else {"speculative_config": speculative}
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=128, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm.engine_core.engine_core.scheduler


@pytest.mark.slow
def test_greedy_output_is_the_same_whatever_the_policy_decides(policy_plugin: None) -> None:
    prompts = repeated_span_prompts(6, seed=7)
    reference, _ = _generate(None, prompts)
    for policy in ("fixture_staggered", "fixture_never", "fixture_drop", "adaptive", "batch_size"):
        tokens, scheduler = _generate(policy, prompts)
        assert tokens == reference, policy
        stats = scheduler.total_spec_decoding_stats
        # every step was timed, and the runner kept what the policy allowed
        assert stats.num_steps > 0 and stats.verify_time_s > 0 and stats.num_sampled_reqs >= 6
        if policy == "fixture_never":
            assert (stats.num_drafts, stats.num_drafted_reqs, stats.draft_time_s) == (0, 0, 0.0)
        if policy == "fixture_drop":  # the drafter ran, nothing it found was verified
            assert (stats.num_drafts, stats.num_drafted_reqs) == (0, 0) and stats.draft_time_s > 0
        if policy == "fixture_staggered":
            # 6 requests: 5 of 6 draft while all run; never more than k per draft
            assert 0 < stats.num_drafted_reqs < stats.num_sampled_reqs
            assert stats.num_draft_tokens <= K * stats.num_drafts and stats.draft_time_s > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafters_propose_no_more_than_the_policy_keeps(method: str) -> None:
    from pagedllm.spec_decode.interface import DraftInputs
    from pagedllm.spec_decode.ngram import NgramDrafter
    from pagedllm.spec_decode.suffix import SuffixDrafter

    config = _config(prompt_lookup_min=1, prompt_lookup_max=3)
    drafter = (NgramDrafter if method == "ngram" else SuffixDrafter)(config, None)  # type: ignore[arg-type]
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # "5 6" matched: 7 8 9 follow
    inputs = DraftInputs(req_ids=["a", "b", "c"], token_ids=[tokens] * 3, sampling_params=[], num_drafts=[3, 1, 0])
    assert drafter.propose(inputs).draft_token_ids == [[7, 8, 9], [7], []]
    inputs.num_drafts = []  # not given: k each
    assert drafter.propose(inputs).draft_token_ids == [[7, 8, 9]] * 3


@pytest.mark.slow
def test_a_model_drafter_still_mirrors_prefill_chunks_that_sample_nothing() -> None:
    # The draft model is the target: every greedy draft is right, unless the
    # drafter missed a prompt chunk (a step in which nothing sampled).
    prompts = repeated_span_prompts(2, seed=11)
    speculative = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": K}
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8,
              enable_chunked_prefill=True, speculative_config=speculative)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
