"""Async scheduling on the shipped tiny model gives synchronous scheduling's
greedy tokens, in one batch that hits the prefix cache, preempts, follows
JSON schemas and (with a drafter, where it falls back to synchronous steps)
verifies drafts; in this process, in the engine-core process and over mp ranks."""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers.json_schemas import SCHEMAS

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO

# 12 blocks of 16 tokens for 12 requests of up to ~80 tokens: they preempt.
ENGINE_KWARGS: dict[str, Any] = {"model": "tiny", "dtype": "float32", "num_kv_blocks": 12, "max_num_seqs": 8}
SHARED_PREFIX = list(range(40, 72))  # two full blocks every prompt starts with


def _workload() -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts, params = [], []
    for index in range(12):
        tail = [rng.randrange(8, 1000) for _ in range(rng.randrange(2, 20))]
        prompts.append({"prompt_token_ids": SHARED_PREFIX + tail})
        if index % 4 == 3:
            schema = SCHEMAS[["flat_object", "enum_string", "pattern_code"][index // 4]]
            params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(json=schema)))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=20 + 3 * index, ignore_eos=index % 2 == 0))
    return prompts, params


def _generate(llm: LLM) -> list[list[int]]:
    prompts, params = _workload()
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def sync_tokens() -> list[list[int]]:
    return _generate(LLM(**ENGINE_KWARGS))


StopRun = tuple[list[dict[str, Any]], list[SamplingParams], list[list[int]]]


@pytest.fixture(scope="module")
def stop_reference() -> StopRun:
    """Six prompts of the batch above, each ended by a stop token or a stop
    string from the middle of its own greedy output (so inside some step's
    accepted drafts), with their synchronous greedy tokens."""
    llm = LLM(**ENGINE_KWARGS)
    prompts = _workload()[0][:6]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    params = []
    for index, output in enumerate(free):
        token_ids, text = output.outputs[0].token_ids, output.outputs[0].text
        middle = text[len(text) // 2 : len(text) // 2 + 2]
        stop: dict[str, Any] = (
            {"stop": [middle]} if index % 2 == 0 and middle.strip() else {"stop_token_ids": [token_ids[12]]}
        )
        params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **stop))
    stopped = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(token_ids) < 24 for token_ids in stopped)  # every one ended early
    return prompts, params, stopped


def _count_launches_ahead(llm: LLM) -> list[int]:
    """Launches made while another step was in flight (wraps the executor)."""
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    executor = core.model_executor
    launch = executor.execute_model_async
    ahead = [0]

    def counting_launch(scheduler_output: Any) -> Any:
        ahead[0] += bool(core.batch_queue)
        return launch(scheduler_output)

    executor.execute_model_async = counting_launch
    return ahead


def test_async_scheduling_gives_the_synchronous_tokens_with_hits_preemption_and_grammars(
    sync_tokens: list[list[int]],
) -> None:
    llm = LLM(async_scheduling=True, **ENGINE_KWARGS)
    launches_ahead = _count_launches_ahead(llm)
    assert _generate(llm) == sync_tokens
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    assert core.scheduler.async_scheduling
    assert launches_ahead[0] > 0  # steps really were scheduled ahead
    assert core.scheduler.num_preemptions > 0
    assert core.kv_cache_manager.total_prefix_cache_hits > 0
    assert len(sync_tokens[3]) > 0 and sync_tokens[3][-1] == llm.eos_token_id  # a grammar request finished by EOS


def test_async_scheduling_in_the_engine_core_process(sync_tokens: list[list[int]]) -> None:
    llm = LLM(async_scheduling=True, multiprocess=True, **ENGINE_KWARGS)
    try:
        assert _generate(llm) == sync_tokens
    finally:
        llm.engine_core.shutdown()


@pytest.mark.slow
def test_async_scheduling_over_mp_ranks(sync_tokens: list[list[int]]) -> None:
    llm = LLM(async_scheduling=True, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_KWARGS)
    try:
        assert _generate(llm) == sync_tokens
    finally:
        llm.engine_core.shutdown()


# Policy "always": the default policy's choices follow step timings, and with
# them how many KV slots drafts take (the preemptions asserted below).
DRAFTERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 2, "model": "tiny-eagle"},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "tiny-draft"},
}
DRAFTERS = {method: {**config, "policy": "always"} for method, config in DRAFTERS.items()}


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_drafts_under_async_scheduling_give_the_synchronous_tokens(
    method: str, sync_tokens: list[list[int]], stop_reference: StopRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps are scheduled ahead with draft placeholders the runner fills, in
    the batch above (prefix hits, preemption, grammars beside them) and in
    one whose requests end on a stop token or string; the acceptance counts
    are those of the drafts the runner really verified."""
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")
    llm = LLM(async_scheduling=True, speculative_config=DRAFTERS[method], **ENGINE_KWARGS)
    launches_ahead = _count_launches_ahead(llm)
    verified = _count_verified_drafts(llm, monkeypatch)
    assert _generate(llm) == sync_tokens
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    assert core.scheduler.async_scheduling and launches_ahead[0] > 0
    assert core.scheduler.num_preemptions > 0
    stats = core.scheduler.total_spec_decoding_stats
    assert stats.num_accepted_tokens > 0
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == tuple(verified)
    assert not core.scheduler.requests and not core.scheduler._preempted_in_flight
    prompts, params, stopped = stop_reference
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == stopped


def _count_verified_drafts(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[verification steps with drafts, drafts, accepted drafts] that the
    runner verified, for the outputs the scheduler took (a request that ended
    while its next step ran has that step's verification ignored)."""
    from pagedllm.worker import model_runner

    counts = [0, 0, 0]
    step_counts: dict[str, tuple[int, int]] = {}
    by_output: dict[int, dict[str, tuple[int, int]]] = {}
    verify, execute = model_runner.verify_drafts, model_runner.ModelRunner.execute_model

    def counting_verify(sampler: Any, raw_logits: Any, sampling: Any) -> Any:
        sampled = verify(sampler, raw_logits, sampling)
        for state, drafts, token_ids in zip(sampling.requests, sampling.drafts, sampled.token_ids, strict=True):
            if drafts:
                step_counts[state.req_id] = (len(drafts), len(token_ids) - 1)
        return sampled

    def recording_execute(runner: Any, scheduler_output: Any) -> Any:
        step_counts.clear()
        output = execute(runner, scheduler_output)
        by_output[id(output)] = dict(step_counts)
        return output

    scheduler = llm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    update = scheduler.update_from_output

    def counting_update(scheduler_output: Any, runner_output: Any) -> Any:
        for req_id, (num_drafts, num_accepted) in by_output.pop(id(runner_output), {}).items():
            if req_id in scheduler.requests:
                counts[0] += 1
                counts[1] += num_drafts
                counts[2] += num_accepted
        return update(scheduler_output, runner_output)

    monkeypatch.setattr(model_runner, "verify_drafts", counting_verify)
    monkeypatch.setattr(model_runner.ModelRunner, "execute_model", recording_execute)
    monkeypatch.setattr(scheduler, "update_from_output", counting_update)
    return counts
