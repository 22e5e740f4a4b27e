"""logit_bias (OpenAI's {token id: bias in [-100, 100]}): added to the logits
before penalties, temperature, top-k/top-p/min-p and sampling, greedy too,
per request row, at every verified position under speculative decoding.

References: the same logits plus a dense bias in plain torch; the engine's
own unbiased run (logprobs are of the raw distribution, so they name the
second-best token a -100 bias must fall back to).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.wire import (
    AddRequests,
    CoreInputDecoder,
    CoreInputEncoder,
    from_engine_core_request,
)
from pagedllm.worker.sampler import Sampler, SamplingMetadata

VOCAB_SIZE = 32


def _metadata(params: list[SamplingParams], generators: dict[int, torch.Generator] | None = None,
              output: list[list[int]] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], output or [[] for _ in range(n)],
                                  generators or {}, VOCAB_SIZE, "cpu")


def _dense(params: list[SamplingParams]) -> torch.Tensor:
    """The reference: every row's bias as a dense [N, V] tensor."""
    bias = torch.zeros(len(params), VOCAB_SIZE)
    for row, p in enumerate(params):
        for token_id, value in (p.logit_bias or {}).items():
            bias[row, token_id] = value
    return bias


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 2


# ------------------------------------------------------------------ sampler


def test_biased_greedy_picks_the_argmax_of_logits_plus_bias() -> None:
    logits = _logits(4)
    order = logits.argsort(dim=-1, descending=True)
    best, second, last = order[:, 0].tolist(), order[:, 1].tolist(), order[:, -1].tolist()
    # Just enough to lift row 0's second best over its best; row 3's worst to the top.
    lift = float(logits[0, best[0]] - logits[0, second[0]]) + 0.01
    params = [
        SamplingParams(temperature=0.0, logit_bias={second[0]: lift}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={best[2]: -100.0}),
        SamplingParams(temperature=0.0, logit_bias={last[3]: 100.0, best[3]: 0.5}),
    ]
    sampled = Sampler()(logits, _metadata(params)).sampled_token_ids.tolist()
    assert sampled == (logits + _dense(params)).argmax(dim=-1).tolist()
    assert sampled == [second[0], best[1], second[2], last[3]]


def test_seeded_sampling_with_a_bias_equals_sampling_from_the_shifted_logits() -> None:
    logits = _logits(3, seed=1)
    rng = random.Random(0)
    common: dict[str, Any] = {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.01}
    biased = [SamplingParams(seed=10 + row, logit_bias={rng.randrange(VOCAB_SIZE): rng.uniform(-5, 5)
                                                        for _ in range(8)}, **common) for row in range(3)]
    plain = [SamplingParams(seed=10 + row, **common) for row in range(3)]
    shifted = logits + _dense(biased)

    def generators(params: list[SamplingParams]) -> dict[int, torch.Generator]:
        return {row: torch.Generator().manual_seed(p.seed) for row, p in enumerate(params)}

    def draws(params: list[SamplingParams], batch_logits: torch.Tensor) -> list[list[int]]:
        metadata = _metadata(params, generators(params))
        return [Sampler()(batch_logits, metadata).sampled_token_ids.tolist() for _ in range(40)]

    assert draws(biased, logits) == draws(plain, shifted)
    # The distribution the sampler draws from is exactly the shifted one, and differs from the unbiased one.
    sampler = Sampler()
    biased_meta, plain_meta = _metadata(biased, generators(biased)), _metadata(plain, generators(plain))
    probs = sampler.compute_probs(sampler.apply_logits_processors(logits, biased_meta), biased_meta)
    torch.testing.assert_close(probs, sampler.compute_probs(shifted, plain_meta), rtol=0, atol=0)
    assert not torch.allclose(probs, sampler.compute_probs(logits, plain_meta), atol=1e-3)


def test_bias_comes_before_the_repetition_penalty() -> None:
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 5] = 1.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={5: -3.0})]
    processed = Sampler.apply_logits_processors(logits, _metadata(params, output=[[5]]))
    # (1 - 3) = -2 is negative, so the penalty multiplies: -4 (penalty first would give 0.5 - 3 = -2.5).
    assert processed[0, 5].item() == -4.0


def test_raw_logits_are_left_untouched_for_logprobs() -> None:
    logits = _logits(2)
    raw = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={1: 50.0}), SamplingParams(temperature=0.0)]
    processed = Sampler.apply_logits_processors(logits, _metadata(params))
    assert torch.equal(logits, raw)
    assert processed[0, 1].item() == pytest.approx(raw[0, 1].item() + 50.0)


def test_a_batch_without_bias_builds_and_copies_nothing() -> None:
    metadata = _metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)])
    assert metadata.logit_bias is None
    logits = _logits(2)
    assert Sampler.apply_logits_processors(logits, metadata) is logits


def test_bias_ids_past_the_logits_never_index_past_them() -> None:
    # Validation refuses these (validate_vocab); the sampler must still not crash.
    params = [SamplingParams(temperature=0.0, logit_bias={VOCAB_SIZE: 100.0, 3: 100.0})]
    metadata = _metadata(params)
    assert metadata.logit_bias is not None and metadata.logit_bias[1].tolist() == [3]
    assert Sampler()(_logits(1), metadata).sampled_token_ids.tolist() == [3]


def test_logit_bias_crosses_the_engine_wire_with_int_keys() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={3: 1.5, 8191: -100, 0: 100.0})
    request = make_request("r", None, [1, 2, 3], params, 1.0, eos_token_id=2)
    wire = CoreInputDecoder().decode(CoreInputEncoder().encode(AddRequests(request.engine_requests())))
    assert isinstance(wire, AddRequests)
    rebuilt = from_engine_core_request(wire.requests[0]).sampling_params
    assert rebuilt.logit_bias == {3: 1.5, 8191: -100.0, 0: 100.0}
    assert all(type(k) is int for k in rebuilt.logit_bias)


# -------------------------------------------------------------- offline LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12], [40, 41, 42, 43, 44, 40, 41, 42], [300, 7, 300, 7, 300]]


def _model_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=128)


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=128, speculative_config=NGRAM)


def _tokens(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "n": 2, "seed": 3},
                                      {"temperature": 1.0, "top_p": 0.5}], ids=["greedy", "seeded-n2", "top-p"])
def test_plus_100_makes_every_generated_token_that_token(llm: LLM, sampling: dict[str, Any]) -> None:
    token = 4242
    params = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={token: 100.0}, **sampling)
    assert _tokens(llm, params) == [[[token] * 6] * params.n] * len(PROMPTS)


def test_minus_100_on_the_greedy_token_falls_back_to_the_second_best(llm: LLM) -> None:
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), use_tqdm=False)
    for prompt, output in zip(PROMPTS, first, strict=True):
        ranked = {entry.rank: token_id for token_id, entry in output.outputs[0].logprobs[0].items()}
        params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={ranked[1]: -100.0})
        biased = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(biased[0].outputs[0].token_ids) == [ranked[2]]


def test_speculative_decoding_verifies_drafts_against_the_biased_target(llm: LLM, spec_llm: LLM) -> None:
    rng = random.Random(5)
    bias = {rng.randrange(8192): 4.0 for _ in range(300)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    reference = _tokens(llm, params)
    assert reference != _tokens(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert _tokens(spec_llm, params) == reference
    # All-t output is drafted by n-gram lookup; drafts are accepted only if every
    # verified position sees the +100 too.
    stats = spec_llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    accepted_before = stats.num_accepted_tokens
    forced = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={77: 100.0})
    assert _tokens(spec_llm, forced) == [[[77] * 12]] * len(PROMPTS)
    assert stats.num_accepted_tokens > accepted_before


# ------------------------------------------------------------------ server

MODEL_NAME = "tiny-logit-bias"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(_model_path(), "--num-kv-blocks", "64", "--max-model-len", "256",
                      "--served-model-name", MODEL_NAME) as srv:
        yield srv


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.slow
def test_server_applies_logit_bias_and_refuses_bad_keys_and_best_of(server: ServerProcess) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_model_path()))
    token = tokenizer.encode("hello", add_special_tokens=False)[-1]
    base = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
    ok = _post(server, "/v1/completions", {**base, "logit_bias": {str(token): 100}, "best_of": 1})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == tokenizer.decode([token] * 4)
    chat = _post(server, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0.0,
                                                   "messages": [{"role": "user", "content": "hi"}],
                                                   "logit_bias": {str(token): 100}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == tokenizer.decode([token] * 3)
    for body, param in [
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"8192": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
        ({"best_of": 2}, "best_of"),
        ({"seed": 10**30}, "seed"),
        ({"priority": 2**64}, "priority"),
        ({"stop_token_ids": [10**30]}, "stop_token_ids.0"),
        ({"stop_token_ids": [8192]}, "stop_token_ids"),
    ]:
        response = _post(server, "/v1/completions", {**base, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert len(error["message"]) < 200
    assert _post(server, "/v1/completions", base).status_code == 200
