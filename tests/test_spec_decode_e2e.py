"""Speculative decoding end to end through LLM: speculation never changes what
the target produces. Every expectation comes from a run of the same engine
without speculation in the same test (greedy token ids must be identical).

Models: the shipped tiny family (pagedllm-tiny, pagedllm-tiny-draft,
pagedllm-tiny-eagle) when its weights are present, else random-weight test
models with the shipped tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers.json_schemas import MAX_TOKENS, SCHEMAS
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.model_registry.tiny import MODEL_ALIASES, WEIGHTS_DIR
from pagedllm.testing.suites.drafter import repeated_span_prompts

NUM_PROMPTS = 16
METHODS = ["ngram", "suffix", "draft_model", "eagle", "eagle3"]
MAX_NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


def _shipped(alias: str) -> Path | None:
    folder = WEIGHTS_DIR / MODEL_ALIASES.get(alias, "pagedllm-" + alias)
    return folder if (folder / "config.json").is_file() else None


def _target() -> str:
    shipped = _shipped("tiny")
    return str(shipped) if shipped else str(cached_tiny_model("llama", with_tokenizer=True, seed=1234))


def _drafter_config(method: str, k: int) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "draft_model":
        shipped = _shipped("tiny-draft") if _shipped("tiny") else None
        model = str(shipped) if shipped else str(
            cached_tiny_model("llama", with_tokenizer=True, seed=99, num_hidden_layers=1)
        )
        return {"method": "draft_model", "num_speculative_tokens": k, "model": model}
    if method == "eagle":
        shipped = _shipped("tiny-eagle") if _shipped("tiny") else None
        return {"method": "eagle", "num_speculative_tokens": k, "model": str(shipped or _random_eagle_head())}
    if method == "eagle3":  # no head shipped: a random one in vLLM's layout
        return {"method": "eagle3", "num_speculative_tokens": k, "model": str(_random_eagle3_head())}
    raise ValueError(method)


_eagle_dir: list[Path] = []
_eagle3_dir: list[Path] = []


def _random_eagle3_head() -> Path:
    if not _eagle3_dir:
        import tempfile

        from helpers.eagle3_heads import save_random_eagle3_head

        _eagle3_dir.append(save_random_eagle3_head(_target(), Path(tempfile.mkdtemp(prefix="pagedllm-eagle3-")) / "h"))
    return _eagle3_dir[0]


def _random_eagle_head() -> Path:
    if not _eagle_dir:
        import tempfile

        from pagedllm.training.train_eagle import save_random_eagle_head

        _eagle_dir.append(save_random_eagle_head(_target(), Path(tempfile.mkdtemp(prefix="pagedllm-eagle-")) / "head"))
    return _eagle_dir[0]


def _greedy(max_tokens: int = MAX_NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _llm(speculative: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    if speculative is not None:
        kwargs["speculative_config"] = speculative
    return LLM(model=_target(), dtype="float32", **kwargs)


def _spec_stats(llm: LLM) -> Any:
    return llm.engine_core.engine_core.scheduler.total_spec_decoding_stats


_reference_cache: dict[Any, list[list[int]]] = {}


def _reference(prompts: list[list[int]], params: SamplingParams, **kwargs: Any) -> list[list[int]]:
    key = (repr(prompts), repr(params), repr(sorted(kwargs.items())))
    if key not in _reference_cache:
        _reference_cache[key] = _generate(_llm(**kwargs), prompts, params)
    return _reference_cache[key]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_identical_with_speculation(method: str, k: int) -> None:
    prompts = repeated_span_prompts(NUM_PROMPTS, seed=0)
    llm = _llm(_drafter_config(method, k))
    assert _generate(llm, prompts, _greedy()) == _reference(prompts, _greedy())
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > 0  # speculation actually happened
    if method in ("ngram", "suffix") or (_shipped("tiny") and method != "eagle3"):  # a random head may never be right
        assert stats.num_accepted_tokens > 0


def test_draft_model_equal_to_target_accepts_every_greedy_draft() -> None:
    target = _target()
    llm = _llm({"method": "draft_model", "num_speculative_tokens": 4, "model": target})
    prompts = repeated_span_prompts(8, seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == _reference(prompts, _greedy())
    for output in outputs:  # per request, too
        assert output.metrics.spec_acceptance_rate == 1.0
        assert output.metrics.spec_num_draft_tokens > 0
        # 24 tokens: the prefill's token, then steps of 1 + 4 (the last one capped).
        assert output.metrics.spec_mean_acceptance_length > 4.0
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts


@pytest.mark.parametrize("method", METHODS)
def test_preemption_during_speculation_leaves_outputs_identical(method: str) -> None:
    prompts = repeated_span_prompts(8, seed=5)
    params = _greedy(max_tokens=48)
    # 16 blocks of 16 tokens for 8 requests of ~30 + 48 tokens: preemption is certain.
    llm = _llm(_drafter_config(method, 3), num_kv_blocks=16, max_model_len=128)
    assert _generate(llm, prompts, params) == _reference(prompts, params)
    assert llm.engine_core.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hits_during_speculation_leave_outputs_identical(method: str) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(8, 400) for _ in range(40)]
    prompts = [shared + p for p in repeated_span_prompts(6, seed=7)]
    params = _greedy()
    llm = _llm(_drafter_config(method, 3))
    first = _generate(llm, prompts, params)
    second = _generate(llm, prompts, params)  # every prompt hits the cache now
    reference = _reference(prompts, params)
    assert first == reference
    assert second == reference
    assert llm.engine_core.engine_core.kv_cache_manager.total_prefix_cache_hits > 0


@pytest.mark.parametrize("method", METHODS)
def test_penalties_min_tokens_and_logprobs_follow_the_target(method: str) -> None:
    prompts = repeated_span_prompts(6, seed=13)
    params = [
        _greedy(repetition_penalty=1.3),
        _greedy(frequency_penalty=0.5, presence_penalty=0.3),
        _greedy(logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, min_tokens=10, logprobs=1),
        _greedy(),
        _greedy(repetition_penalty=0.8),
    ]
    reference_llm = _llm()
    expected = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = _llm(_drafter_config(method, 3))
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for param, want, have in zip(params, expected, got, strict=True):
        assert list(have.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        # Logprobs exactly where asked for, so the comparison below cannot be skipped.
        assert (want.outputs[0].logprobs is not None) == (param.logprobs is not None)
        assert (have.outputs[0].logprobs is not None) == (param.logprobs is not None)
        if param.logprobs is not None:
            for want_lp, have_lp in zip(want.outputs[0].logprobs, have.outputs[0].logprobs, strict=True):
                assert set(want_lp) == set(have_lp)
                for token_id in want_lp:
                    assert have_lp[token_id].logprob == pytest.approx(want_lp[token_id].logprob, abs=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_with_speculation_is_reproducible(method: str) -> None:
    prompts = repeated_span_prompts(6, seed=17)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_NEW_TOKENS) for i in range(6)]
    first = _generate(_llm(_drafter_config(method, 3)), prompts, params)
    second = _generate(_llm(_drafter_config(method, 3)), prompts, params)
    assert first == second
    assert all(len(tokens) > 0 for tokens in first)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(method: str) -> None:
    # The drafts of a seeded request come from its own generator too, so the
    # batch around it (here: unseeded random requests) cannot change them.
    prompts = repeated_span_prompts(5, seed=19)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True) for _ in range(4)]
    llm = _llm(_drafter_config(method, 3))
    (alone,) = _generate(llm, prompts[:1], seeded)
    in_batch = _generate(llm, prompts[1:3] + prompts[:1] + prompts[3:], [*others[:2], seeded, *others[2:]])
    assert in_batch[2] == alone and len(alone) == MAX_NEW_TOKENS
    assert _spec_stats(llm).num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_json_schema_output_stays_valid_under_speculation(method: str) -> None:
    llm = _llm(_drafter_config(method, 3), num_kv_blocks=512, max_model_len=512)
    names = list(SCHEMAS)[:12]
    prompts = [[10 + i, 20, 30, 40] for i in range(len(names))]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 1.0, seed=None if i % 2 == 0 else i, max_tokens=MAX_TOKENS,
            structured_outputs=SO(json=SCHEMAS[name], disable_any_whitespace=True),
        )
        for i, name in enumerate(names)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for name, output in zip(names, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (name, completion.text)
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
    assert _spec_stats(llm).num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_and_a_tight_token_budget_leave_outputs_identical(method: str) -> None:
    # 10 tokens per step: prompts arrive in chunks and 1 + k rarely fits for everyone.
    prompts = repeated_span_prompts(6, seed=19)
    llm = _llm(_drafter_config(method, 4), max_num_batched_tokens=10, max_model_len=128)
    assert _generate(llm, prompts, _greedy()) == _reference(prompts, _greedy())
    assert _spec_stats(llm).num_draft_tokens > 0


def test_drafts_stop_at_max_model_len() -> None:
    # Prompts end 6 tokens before max_model_len: generation is cut by length,
    # and no draft may reach past the last position.
    prompts = [p[:20] for p in repeated_span_prompts(4, seed=23)]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for method in METHODS:
        llm = _llm(_drafter_config(method, 5), max_model_len=26)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        reference = _llm(max_model_len=26).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for got, want in zip(outputs, reference, strict=True):
            assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
            assert got.outputs[0].finish_reason == "length"


def test_penalties_see_the_drafts_before_each_position() -> None:
    # The unpenalized draft model (= the target) wants to repeat itself; under
    # strong penalties the target must refuse a draft that repeats an earlier
    # draft of the same step, so row j's counts must include drafts[:j].
    prompts = repeated_span_prompts(6, seed=29)
    params = [
        _greedy(max_tokens=64, frequency_penalty=2.0),
        _greedy(max_tokens=64, presence_penalty=2.0),
        _greedy(max_tokens=64, repetition_penalty=3.0),
    ] * 2
    expected = _generate(_llm(), prompts, params)
    llm = _llm({"method": "draft_model", "num_speculative_tokens": 5, "model": _target()})
    assert _generate(llm, prompts, params) == expected


def test_spawned_engine_core_speculates_and_reports_counts() -> None:
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.core_client import SyncMPClient
    from pagedllm.engine.input_processor import make_request

    prompts = repeated_span_prompts(4, seed=31)
    params = _greedy()
    config = EngineConfig.load(
        model={"model": _target(), "dtype": "float32"}, cache={"num_kv_blocks": 128},
        speculative=_drafter_config("ngram", 3),
    )
    client = SyncMPClient(config)
    try:
        for i, ids in enumerate(prompts):
            client.add_requests(make_request(f"req-{i}", None, ids, params).engine_requests())
        tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
        counts: dict[str, Any] = {}
        finished: set[str] = set()
        while len(finished) < len(prompts):
            for output in client.get_output():
                tokens[output.request_id].extend(output.new_token_ids)
                counts[output.request_id] = output.spec_counts
                if output.finished:
                    finished.add(output.request_id)
    finally:
        client.shutdown()
    assert [tokens[f"req-{i}"] for i in range(len(prompts))] == _reference(prompts, params)
    assert all(c is not None and c[1] >= c[2] >= 0 for c in counts.values())
    assert sum(c[1] for c in counts.values()) > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafter_frees_what_it_keeps_when_requests_finish_or_abort(method: str) -> None:
    from pagedllm.core.request import Request

    llm = _llm(_drafter_config(method, 3))
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    drafter = llm.engine_core.executor.driver_worker.drafter  # type: ignore[attr-defined]
    kept = drafter.requests if method == "suffix" else drafter.buffers
    prompts = repeated_span_prompts(4, seed=41)
    for i, max_tokens in enumerate([3, 60, 60]):
        core.add_request(Request(f"r{i}", prompts[i], _greedy(max_tokens), eos_token_id=None))
    for _ in range(8):  # r0 finishes (3 tokens), r1 and r2 keep decoding
        core.step()
    core.abort_requests(["r1"])
    core.step()  # the runner learns of r0 and r1 before this step
    assert set(kept) == {"r2"}
    core.abort_requests(["r2"])
    core.add_request(Request("r3", prompts[3], _greedy(4), eos_token_id=None))
    core.step()
    assert set(kept) == {"r3"}
    if method == "suffix":  # finished outputs stay in the global tree, in finishing order
        assert list(drafter.cached_outputs) == ["r0", "r1", "r2"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_model_drafters_draft_the_same_under_graphs_as_eagerly(method: str) -> None:
    """The target's and the drafter's steps replay graphs (EAGLE-3's layer
    inputs come out of the target's replays; the drafter's catch-ups over
    each request's kept rows, padded where they differ, too): every
    proposal is the one the eager engine makes."""
    prompts = repeated_span_prompts(4, seed=1)

    def proposals(llm: LLM) -> list[list[list[int]]]:
        runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner  # type: ignore[attr-defined]
        seen: list[list[list[int]]] = []
        propose = runner.drafter.propose
        runner.drafter.propose = lambda inputs: _record(propose, inputs, seen)
        _generate(llm, prompts, _greedy())
        return seen

    # policy always: the default one drafts by measured (so varying) step times.
    speculative = {**_drafter_config(method, 3), "policy": "always"}
    eager = proposals(_llm(speculative, enforce_eager=True))
    llm = _llm(speculative)
    assert proposals(llm) == eager and any(eager)
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner  # type: ignore[attr-defined]
    assert runner.graph_runner.num_replays > 0 and runner.drafter.draft_graphs.num_replays > 0
    draft_graphs = runner.drafter.draft_graphs
    if method != "eagle3":  # the shipped heads get drafts accepted: catch-ups of several rows (eagle3's is random)
        assert max(draft_graphs.num_replays_by_query_len) > 1 and draft_graphs.num_padded_replays > 0


def _record(propose: Any, inputs: Any, seen: list[list[list[int]]]) -> Any:
    output = propose(inputs)
    seen.append(output.draft_token_ids)
    return output
