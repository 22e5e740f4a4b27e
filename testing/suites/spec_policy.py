"""Conformance suite of the ``spec_policy`` kind: a speculation policy may
draft more or less, never out of bounds, and never changes greedy output.

The bounds rule asks the policy about batches of several sizes over made-up
measurements (acceptances from 0 to 1, verify steps cheaper and dearer than
plain ones, requests never verified, requests held at 0 drafts for long);
the output rule runs the n-gram drafter under the policy in an engine on the
shipped tiny model and compares its greedy tokens with no speculation.
"""

from __future__ import annotations

import random
from typing import Any

from pagedllm.testing.components import load
from pagedllm.testing.engine_runs import generate_tokens, limit_steps, tiny_llm
from pagedllm.testing.suite import ConformanceError, Suite

KIND = "spec_policy"
SUITE = Suite(KIND)

NUM_SPECULATIVE_TOKENS = 3
MAX_STEPS = 400


def _config(name: str, **fields: Any) -> Any:
    from pagedllm.core.config import SpeculativeConfig

    return SpeculativeConfig(method="ngram", num_speculative_tokens=NUM_SPECULATIVE_TOKENS, policy=name, **fields)


def _build(rule: str, name: str) -> Any:
    cls = load(rule, KIND, name)
    try:
        return cls(_config(name))
    except Exception as exc:
        raise ConformanceError(rule, f"{cls.__name__}(config) raised {type(exc).__name__}: {exc}") from exc


def _measurements(rng: random.Random, batch_size: int) -> tuple[Any, list[str]]:
    from pagedllm.spec_decode.measurements import SpecMeasurements

    measurements = SpecMeasurements()
    plain = rng.uniform(0.001, 0.02)
    for verified, seconds in ((False, plain), (True, plain * rng.uniform(0.5, 4.0))):
        if rng.random() < 0.8:  # sometimes a bucket has not been measured yet
            measurements.observe_step(batch_size, verified=verified, step_s=seconds, rest_s=rng.uniform(0, 0.002))
    req_ids = [f"r{index}" for index in range(batch_size)]
    for req_id in req_ids:
        for _ in range(rng.randrange(0, 4)):  # 0: never verified
            proposed = rng.randrange(1, NUM_SPECULATIVE_TOKENS + 1)
            measurements.observe_acceptance(req_id, proposed, rng.randrange(0, proposed + 1))
        for _ in range(rng.randrange(0, 40)):
            measurements.observe_drafted(req_id, 0)
    return measurements, req_ids


@SUITE.rule("counts-in-range")
def check_counts_in_range(name: str) -> None:
    """For every batch, one int count per request, each in 0..num_speculative_tokens."""
    rule = "counts-in-range"
    policy = _build(rule, name)
    rng = random.Random(0)
    for batch_size in (1, 2, 3, 8, 33):
        for _ in range(8):
            measurements, req_ids = _measurements(rng, batch_size)
            counts = policy.num_drafts(req_ids, measurements)
            if (not isinstance(counts, list) or len(counts) != batch_size
                    or not all(isinstance(c, int) and 0 <= c <= NUM_SPECULATIVE_TOKENS for c in counts)):
                raise ConformanceError(
                    rule, f"num_drafts() for {batch_size} requests returned {counts!r} "
                    f"(wanted {batch_size} ints in 0..{NUM_SPECULATIVE_TOKENS})"
                )


@SUITE.rule("greedy-output-unchanged")
def check_greedy_output(name: str) -> None:
    """Greedy tokens with the n-gram drafter under the policy equal those without speculation."""
    from pagedllm import SamplingParams
    from pagedllm.testing.suites.drafter import repeated_span_prompts

    rule = "greedy-output-unchanged"
    _build(rule, name)
    prompts = repeated_span_prompts(5, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    speculative = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3, "policy": name}
    try:
        llm = tiny_llm(num_kv_blocks=256, speculative_config=speculative)
    except Exception as exc:
        raise ConformanceError(rule, f"an engine with the policy did not start: {type(exc).__name__}: {exc}") from exc
    limit_steps(rule, llm, MAX_STEPS)
    tokens = generate_tokens(llm, prompts, params)
    expected = generate_tokens(tiny_llm(num_kv_blocks=256), prompts, params)
    if tokens != expected:
        raise ConformanceError(rule, "greedy tokens differ from the engine's without speculation")
