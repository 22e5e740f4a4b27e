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


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "eagle", "num_speculative_tokens": 2, "model": "tiny-eagle"},
    ],
    ids=["ngram", "eagle"],
)
def test_with_a_drafter_async_scheduling_falls_back_to_synchronous_steps(
    speculative: dict[str, Any], sync_tokens: list[list[int]]
) -> None:
    llm = LLM(async_scheduling=True, speculative_config=speculative, **ENGINE_KWARGS)
    assert _generate(llm) == sync_tokens
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    assert not core.scheduler.async_scheduling and core.batch_queue is None
    assert core.scheduler.total_spec_decoding_stats.num_accepted_tokens > 0
