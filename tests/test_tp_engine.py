"""The whole engine at TP=2 (`mp` executor, 2 gloo ranks) gives TP=1's
(`uni`) tokens, through `LLM`.

Each model runs one generate batch per TP size, built so that every
scheduling path happens in it: prompts sharing a 3-block prefix (prefix-cache
hits), prompts longer than `max_num_batched_tokens` (chunked prefill), more
KV than the few blocks hold (preemption by recompute), greedy and seeded
random requests with top-k logprobs, and a JSON-schema request (xgrammar).
The reference is TP=1's run of the same batch: tokens identical, logprobs
allclose (the all-reduces sum partial products in another order), and the
scheduler's figures identical (the same tokens must give the same schedule).

Models: Llama with 2 KV heads (one per rank) and with 1 (replicated),
Qwen2 (q/k/v biases), Qwen3 (q/k norms), random weights with the shipped
tokenizer; and the shipped `tiny`. Speculative decoding (n-gram, EAGLE with
`tiny-eagle`, the draft model `tiny-draft`) at TP=2 against TP=1 with the
same drafter and, for greedy requests, TP=1 without one.

float32 throughout: TP's partial sums change the low bits, which must not
flip a token; in half precision they can, at TP=1 vs TP=2 as between any two
summation orders.

Each engine pair is built once per model (module-scoped, parametrized
fixtures: pytest finishes one model before it builds the next), runs its
batch, and is shut down; the tests read the recorded runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
from helpers.json_prefix import is_json_prefix
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.core.stats import SchedulerStats, SpecDecodingStats
from pagedllm.engine.outputs import RequestOutput
from pagedllm.model_registry.loader import load_hf_config

pytestmark = pytest.mark.slow

# name -> (architecture, config overrides) of a tests/helpers tiny model; None: the shipped `tiny`
TEST_MODELS: dict[str, tuple[str, dict[str, Any]] | None] = {
    "llama-2-kv-heads": ("llama", {}),  # 4 query heads, 2 KV heads: one KV head per rank
    "llama-1-kv-head": ("llama", {"num_key_value_heads": 1}),  # the KV head replicated on both ranks
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "tiny": None,
}
BLOCK_SIZE = 16
PREFIX_BLOCKS = 3
MAX_NUM_BATCHED_TOKENS = 32  # below the shared-prefix prompts' length: their prefill is chunked
NUM_KV_BLOCKS = 16  # fewer than the batch needs at once: requests are preempted
MAX_TOKENS = 24
NUM_LOGPROBS = 3
LOGPROB_TOLERANCE = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SPEC_METHODS: dict[str, dict[str, Any]] = {
    # policy always: the draft counts are compared across runs, and the
    # default policy's choices follow measured (so varying) step times.
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "policy": "always"},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": "tiny-eagle", "policy": "always"},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "tiny-draft", "policy": "always"},
}


@dataclass
class Run:
    outputs: list[RequestOutput]
    stats: SchedulerStats  # of `outputs`' batch alone
    executor: str
    world_size: int
    then_outputs: list[RequestOutput]  # of the batch run after it, if any
    collective_stats: list[dict[str, float]]  # each rank's, after `outputs`' batch
    num_layers: int

    def tokens(self, indices: list[int]) -> list[list[int]]:
        return [list(self.outputs[i].outputs[0].token_ids) for i in indices]


@dataclass
class Batch:
    prompts: list[list[int]]
    params: list[SamplingParams]
    greedy: list[int]  # indices of the unconstrained greedy requests
    seeded: list[int]
    structured: list[int]


def _model_path(name: str) -> str:
    spec = TEST_MODELS[name]
    if spec is None:
        return "tiny"
    arch, overrides = spec
    return str(cached_tiny_model(arch, with_tokenizer=True, seed=7, **overrides))


def _random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(count)]


def _greedy(**extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def _seeded(seed: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def _structured() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=SO(json=SCHEMA))


def scheduling_batch() -> Batch:
    """Four prompts of a shared prefix plus their own 20 tokens (longer than
    the token budget) and a short one.

    NOTE: no structured request here: a grammar compiles asynchronously, so
    when its request is admitted depends on the clock, and so would the
    scheduler's figures this batch compares."""
    rng = random.Random(0)
    prefix = _random_ids(rng, PREFIX_BLOCKS * BLOCK_SIZE)
    prompts = [prefix + _random_ids(rng, 20) for _ in range(4)] + [_random_ids(rng, 9)]
    params = [_greedy(logprobs=NUM_LOGPROBS), _greedy(logprobs=NUM_LOGPROBS),
              _seeded(11, logprobs=NUM_LOGPROBS), _seeded(12), _greedy()]
    return Batch(prompts, params, greedy=[0, 1, 4], seeded=[2, 3], structured=[])


def structured_batch() -> Batch:
    """JSON-schema requests, run on the same engine after the scheduling batch."""
    rng = random.Random(2)
    prompts = [_random_ids(rng, 12), _random_ids(rng, 5)]
    return Batch(prompts, [_structured(), _structured()], greedy=[], seeded=[], structured=[0, 1])


def speculation_batch() -> Batch:
    """Prompts that repeat a span (prompt lookup finds matches)."""
    rng = random.Random(1)
    prompts = []
    for _ in range(4):
        span = _random_ids(rng, rng.randrange(3, 7))
        prompts.append(_random_ids(rng, 3) + (span + _random_ids(rng, 1)) * 3)
    params = [_greedy(), _greedy(), _greedy(), _seeded(5), _structured()]
    return Batch([*prompts, _random_ids(rng, 8)], params, greedy=[0, 1, 2], seeded=[3], structured=[4])


def _generate(llm: LLM, batch: Batch) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in batch.prompts], batch.params, use_tqdm=False)


def _run(model: str, tensor_parallel_size: int, batch: Batch, then: Batch | None = None, **engine_args: Any) -> Run:
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, dtype="float32", **engine_args)
    try:
        llm.get_stats()  # start the interval counts here
        outputs = _generate(llm, batch)
        stats = llm.get_stats()
        assert stats is not None
        collective_stats = llm.engine_core.engine_core.model_executor.collective_rpc(  # type: ignore[attr-defined]
            "collective_stats"
        )
        then_outputs = [] if then is None else _generate(llm, then)
        ready = llm.engine_core.ready
        num_layers = load_hf_config(ready.model_path).num_hidden_layers
        return Run(outputs, stats, ready.executor, ready.world_size, then_outputs, collective_stats, num_layers)
    finally:
        llm.shutdown()


def _runs(model: str, batch: Batch, then: Batch | None = None, **engine_args: Any) -> dict[int, Run]:
    runs = {size: _run(model, size, batch, then, **engine_args) for size in (1, 2)}
    assert (runs[1].executor, runs[1].world_size) == ("uni", 1)
    assert (runs[2].executor, runs[2].world_size) == ("mp", 2)
    return runs


# ------------------------------------------------------ scheduling paths


@pytest.fixture(scope="module", params=list(TEST_MODELS))
def runs(request: pytest.FixtureRequest) -> dict[int, Run]:
    return _runs(_model_path(request.param), scheduling_batch(), structured_batch(), num_kv_blocks=NUM_KV_BLOCKS,
                 block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)


def test_tp2_greedy_tokens_equal_tp1(runs: dict[int, Run]) -> None:
    greedy = scheduling_batch().greedy
    assert runs[2].tokens(greedy) == runs[1].tokens(greedy)
    assert all(len(tokens) == MAX_TOKENS for tokens in runs[1].tokens(greedy))


def test_tp2_seeded_sampling_equals_tp1(runs: dict[int, Run]) -> None:
    seeded = scheduling_batch().seeded
    assert runs[2].tokens(seeded) == runs[1].tokens(seeded)
    # Sampled, not greedy: some token of the request with logprobs was not the most likely.
    sampled = runs[1].outputs[seeded[0]].outputs[0]
    assert sampled.logprobs is not None
    assert any(position[token].rank != 1 for token, position in zip(sampled.token_ids, sampled.logprobs, strict=True))


def test_tp2_top_logprobs_equal_tp1(runs: dict[int, Run]) -> None:
    batch = scheduling_batch()
    with_logprobs = [i for i, params in enumerate(batch.params) if params.logprobs]
    for index in with_logprobs:
        tp1, tp2 = (runs[size].outputs[index].outputs[0].logprobs for size in (1, 2))
        assert tp1 is not None and tp2 is not None and len(tp1) == len(tp2) == MAX_TOKENS
        for position, (expected, got) in enumerate(zip(tp1, tp2, strict=True)):
            assert got.keys() == expected.keys(), (index, position)
            for token_id, logprob in expected.items():
                if logprob.rank is not None and logprob.rank <= NUM_LOGPROBS:  # deep ranks tie at float32
                    assert got[token_id].rank == logprob.rank, (index, position, token_id)
                assert got[token_id].logprob == pytest.approx(logprob.logprob, abs=LOGPROB_TOLERANCE)


def test_tp2_structured_output_equals_tp1(runs: dict[int, Run]) -> None:
    tp1, tp2 = ([list(o.outputs[0].token_ids) for o in runs[size].then_outputs] for size in (1, 2))
    assert tp2 == tp1 and len(tp1) == len(structured_batch().prompts)
    for output in runs[1].then_outputs + runs[2].then_outputs:
        text = output.outputs[0].text
        assert is_json_prefix(text), text  # the grammar held
        if output.outputs[0].finish_reason == "stop":
            assert set(json.loads(text)) == {"name", "age"}


def test_tp2_schedules_like_tp1_with_prefix_hits_chunked_prefill_and_preemption(runs: dict[int, Run]) -> None:
    batch = scheduling_batch()
    assert max(len(prompt) for prompt in batch.prompts) > MAX_NUM_BATCHED_TOKENS  # chunked
    tp1, tp2 = runs[1].stats, runs[2].stats
    assert tp1.prefix_cache_hits > 0
    assert tp1.num_preemptions > 0
    assert (tp2.prefix_cache_queries, tp2.prefix_cache_hits, tp2.num_preemptions) == (
        tp1.prefix_cache_queries, tp1.prefix_cache_hits, tp1.num_preemptions)


def test_each_tp2_step_runs_two_all_reduces_per_layer_plus_embedding_and_logits(runs: dict[int, Run]) -> None:
    """What the benchmark's per-step communication counts: the vocab-parallel
    embedding's all-reduce and o_proj's and down_proj's in every layer, plus
    the logits' all-gather in a step that samples (one whose every request is
    a partial prefill chunk has no logits), on both ranks alike; none at one rank."""
    (tp1,) = runs[1].collective_stats
    assert tp1["num_steps"] > 0 and (tp1["num_collectives"], tp1["collective_seconds"]) == (0, 0.0)
    rank0, rank1 = runs[2].collective_stats
    assert rank0["num_steps"] == rank1["num_steps"] == tp1["num_steps"]
    forward = 2 * runs[2].num_layers + 1
    assert rank0["num_collectives"] == rank1["num_collectives"]
    assert forward * rank0["num_steps"] < rank0["num_collectives"] <= (forward + 1) * rank0["num_steps"]
    assert rank0["collective_seconds"] > 0.0


# ---------------------------------------------------- speculative decoding


@pytest.fixture(scope="module")
def without_speculation() -> Run:
    return _run("tiny", 1, speculation_batch())


@pytest.fixture(scope="module", params=list(SPEC_METHODS))
def spec_runs(request: pytest.FixtureRequest) -> dict[int, Run]:
    return _runs("tiny", speculation_batch(), speculative_config=SPEC_METHODS[request.param])


def _spec_stats(run: Run) -> SpecDecodingStats:
    stats = run.stats.spec_decoding_stats
    assert stats is not None
    return stats


def test_speculative_decoding_at_tp2_gives_tp1s_tokens(spec_runs: dict[int, Run]) -> None:
    every = list(range(len(speculation_batch().prompts)))
    assert spec_runs[2].tokens(every) == spec_runs[1].tokens(every)


def test_speculative_greedy_at_tp2_equals_tp1_without_speculation(
    spec_runs: dict[int, Run], without_speculation: Run
) -> None:
    batch = speculation_batch()
    deterministic = batch.greedy + batch.structured
    assert spec_runs[2].tokens(deterministic) == without_speculation.tokens(deterministic)


def test_drafter_at_tp2_proposes_and_is_accepted_as_at_tp1(spec_runs: dict[int, Run]) -> None:
    tp1, tp2 = _spec_stats(spec_runs[1]), _spec_stats(spec_runs[2])
    assert tp1.num_draft_tokens > 0 and tp1.num_accepted_tokens > 0
    # A drafter that reads the wrong slice of a rank's state still gives the
    # target's tokens, but not the same drafts.
    assert (tp2.num_drafts, tp2.num_draft_tokens, tp2.num_accepted_tokens) == (
        tp1.num_drafts, tp1.num_draft_tokens, tp1.num_accepted_tokens)
