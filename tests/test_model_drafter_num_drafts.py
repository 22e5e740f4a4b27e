"""Model drafters (draft model, EAGLE) draft what the speculation policy gives
each request: a request given 0 drafts costs only its KV mirror (the
catch-up forward), no logits; the draft loop runs as many single-token
steps as the longest draft needs. Greedy output stays the one without
speculation (compared within the test).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.spec_decode.measurements import SpecMeasurements
from pagedllm.spec_decode.policy import SpeculationPolicy
from pagedllm.testing.suites.drafter import repeated_span_prompts

K = 3
SHIPPED = {"draft_model": "tiny-draft", "eagle": "tiny-eagle"}


class OneDraftPolicy(SpeculationPolicy):
    """The first request of a step drafts 1, the others 0."""

    def num_drafts(self, req_ids: Sequence[str], measurements: SpecMeasurements) -> list[int]:
        return [1 if i == 0 else 0 for i in range(len(req_ids))]


class PolicyPlugin:
    @hookimpl
    def register_spec_policies(self, register: RegisterFn) -> None:
        register("fixture_one_draft", f"{__name__}:OneDraftPolicy")


@pytest.fixture
def policy_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    name = pm.register(PolicyPlugin(), name="model-drafter-policy-test-plugin")
    yield
    pm.unregister(name=name)


_reference: dict[str, list[list[int]]] = {}


def _llm(speculative: dict[str, Any] | None) -> LLM:
    extra = {} if speculative is None else {"speculative_config": speculative}
    return LLM(model="tiny", dtype="float32", num_kv_blocks=128, enforce_eager=True, **extra)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _no_spec(prompts: list[list[int]]) -> list[list[int]]:
    key = repr(prompts)
    if key not in _reference:
        _reference[key] = _generate(_llm(None), prompts)
    return _reference[key]


def _count_drafter_work(llm: LLM, method: str) -> dict[str, list[int]]:
    """Per call: rows of each catch-up, of each draft step, and of each
    lm_head the drafter runs (the draft model's own; EAGLE's share of the
    target's)."""
    drafter = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.drafter  # type: ignore[attr-defined]
    calls: dict[str, list[int]] = {"catch_up": [], "draft_step": [], "lm_head": []}

    def counted(name: str, fn: Any, rows: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name].append(rows(*args))
            return fn(*args, **kwargs)
        return wrapper

    drafter._catch_up = counted("catch_up", drafter._catch_up, lambda inputs, *_: len(inputs.req_ids))
    drafter._draft_step = counted("draft_step", drafter._draft_step, lambda tokens, *_: len(tokens))
    if method == "draft_model":
        drafter.model.compute_logits = counted("lm_head", drafter.model.compute_logits, lambda h: len(h))
    else:
        drafter._compute_logits = counted("lm_head", drafter._compute_logits, lambda h: len(h))
    return calls


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_model_drafter_given_no_drafts_runs_only_its_kv_mirror(method: str) -> None:
    prompts = repeated_span_prompts(2, seed=3)
    # vLLM's disable_by_batch_size at 1: no request ever drafts
    speculative = {"method": method, "model": SHIPPED[method], "num_speculative_tokens": K,
                   "policy": "batch_size", "disable_by_batch_size": 1}
    llm = _llm(speculative)
    calls = _count_drafter_work(llm, method)
    assert _generate(llm, prompts) == _no_spec(prompts)
    assert len(calls["catch_up"]) >= 12  # every step still mirrors the target's rows
    assert (calls["draft_step"], calls["lm_head"]) == ([], [])


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_model_drafter_computes_logits_only_for_the_requests_that_draft(
    method: str, policy_plugin: None
) -> None:
    prompts = repeated_span_prompts(3, seed=5)
    speculative = {"method": method, "model": SHIPPED[method], "num_speculative_tokens": K,
                   "policy": "fixture_one_draft"}
    llm = _llm(speculative)
    calls = _count_drafter_work(llm, method)
    assert _generate(llm, prompts) == _no_spec(prompts)
    # one request drafts one token per step: one lm_head row, no further draft step
    assert calls["lm_head"] and set(calls["lm_head"]) == {1}
    assert calls["draft_step"] == []
    stats = llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    assert stats.num_draft_tokens == stats.num_drafts > 0  # every draft was 1 token long
