"""vLLM's per-request token controls: `allowed_token_ids` (only these may be
sampled), `bad_words` (a word's last token is banned right after the rest of
it), `logprob_token_ids` (the logprobs of exactly these tokens at every
sampled position) and `truncate_prompt_tokens` (the last k prompt tokens,
or the first k with truncation_side "right").

References: plain torch over the same logits (sampler); the engine's own run
without the control (bad words, truncation: the truncated prompt sent as
is); Hugging Face's log_softmax on the same tiny model (logprob_token_ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import InvalidRequestError
from pagedllm.engine.bad_words import bad_words_token_ids
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.wire import AddRequests, CoreInputDecoder, CoreInputEncoder, from_engine_core_request
from pagedllm.worker.sampler import Sampler, SamplingMetadata

VOCAB_SIZE = 32


def _metadata(params: list[SamplingParams], output: list[list[int]] | None = None,
              generators: dict[int, torch.Generator] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], output or [[] for _ in range(n)],
                                  generators or {}, VOCAB_SIZE, "cpu")


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


# ------------------------------------------------------------------ sampler


def test_allowed_token_ids_greedy_is_the_argmax_inside_the_set() -> None:
    logits = _logits(3)
    allowed = [[3, 9, 17], [30], [0, 1, 2, 3]]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=ids) for ids in allowed]
    sampled = Sampler()(logits, _metadata(params)).sampled_token_ids.tolist()
    expected = [ids[int(logits[row, ids].argmax())] for row, ids in enumerate(allowed)]
    assert sampled == expected


def test_allowed_token_ids_random_draws_stay_in_the_set_and_other_rows_are_untouched() -> None:
    logits = _logits(2, seed=1)
    params = [SamplingParams(temperature=1.5, seed=4, allowed_token_ids=[5, 6, 7]), SamplingParams(temperature=0.0)]
    metadata = _metadata(params, generators={0: torch.Generator().manual_seed(4)})
    draws = [Sampler()(logits, metadata).sampled_token_ids.tolist() for _ in range(60)]
    assert {row[0] for row in draws} == {5, 6, 7}
    assert {row[1] for row in draws} == {int(logits[1].argmax())}
    processed = Sampler.apply_logits_processors(logits, metadata)
    assert torch.equal(processed[1], logits[1])
    assert torch.equal(processed[0, [5, 6, 7]], logits[0, [5, 6, 7]])
    assert torch.isinf(processed[0]).sum().item() == VOCAB_SIZE - 3


def test_bad_word_last_token_is_banned_only_right_after_its_prefix() -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, 7] = 5.0  # everyone's greedy choice
    logits[:, 9] = 4.0
    words = [[5, 7], [9]]
    params = [SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=words)] * 3
    metadata = _metadata(params, output=[[1, 5], [5, 1], []])
    processed = Sampler.apply_logits_processors(logits, metadata)
    # Row 0 just generated 5: 7 completes [5, 7]; 9 is a one-token word, banned everywhere.
    assert processed[0, 7].item() == float("-inf") and processed[1, 7].item() == 5.0
    assert processed[2, 7].item() == 5.0
    assert all(processed[row, 9].item() == float("-inf") for row in range(3))
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [int(logits[0, :7].argmax()), 7, 7]
    # The ban follows the output: the metadata must be rebuilt every step.
    assert metadata.token_controls is not None and metadata.token_controls.depends_on_output


def test_logprob_token_ids_are_the_raw_log_softmax_at_those_ids() -> None:
    logits = _logits(3, seed=2)
    params = [SamplingParams(temperature=0.0, logprob_token_ids=[4, 0, 31]),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.0, logprob_token_ids=[12], logit_bias={12: 100.0})]
    output = Sampler()(logits, _metadata(params))
    tensors = output.logprobs_tensors
    assert tensors is not None
    reference = logits.log_softmax(dim=-1)
    ids, values, _ = tensors.tolists()
    assert ids[0][1:4] == [4, 0, 31]
    torch.testing.assert_close(torch.tensor(values[0][1:4]), reference[0, [4, 0, 31]])
    # Row 1 keeps its plain top-5; row 2's value is of the raw distribution (before the bias).
    assert ids[1][1:6] == reference[1].topk(5).indices.tolist()
    assert ids[2][1] == 12 and values[2][1] == pytest.approx(reference[2, 12].item(), abs=1e-6)


def test_a_batch_without_token_controls_builds_and_copies_nothing() -> None:
    metadata = _metadata([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, logprobs=2)])
    assert metadata.token_controls is None
    logits = _logits(2)
    assert Sampler.apply_logits_processors(logits, metadata) is logits


def test_token_controls_cross_the_engine_wire() -> None:
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2], bad_words=["ab"],
                            bad_words_token_ids=[[3, 4], [5]], logprob_token_ids=[6], truncate_prompt_tokens=-1,
                            truncation_side="right")
    request = make_request("r", None, [1, 2, 3], params, 1.0, eos_token_id=2)
    wire = CoreInputDecoder().decode(CoreInputEncoder().encode(AddRequests(request.engine_requests())))
    assert isinstance(wire, AddRequests)
    rebuilt = from_engine_core_request(wire.requests[0]).sampling_params
    controls = (rebuilt.allowed_token_ids, rebuilt.bad_words_token_ids, rebuilt.logprob_token_ids)
    assert controls == ([1, 2], [[3, 4], [5]], [6])
    assert (rebuilt.truncate_prompt_tokens, rebuilt.truncation_side, rebuilt.num_logprobs) == (-1, "right", 1)


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "[0,"),
    ({"logprob_token_ids": list(range(21))}, "logprob_token_ids", "at most 20"),
    ({"logprob_token_ids": [1, 2], "logprobs": 3}, "logprob_token_ids", "logprobs (3)"),
    ({"bad_words": [""]}, "bad_words", "non-empty"),
    ({"bad_words": ["x"] * 129}, "bad_words", "at most 128"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "-1"),
    ({"truncation_side": "middle"}, "truncation_side", "'left' or 'right'"),
])
def test_malformed_token_controls_are_refused_naming_the_field(fields: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert info.value.field == field
    assert words in info.value.limit


@pytest.mark.parametrize("field", ["allowed_token_ids", "logprob_token_ids"])
def test_a_token_id_past_the_vocabulary_is_refused_with_the_vocabulary_size(field: str) -> None:
    params = SamplingParams(**{field: [3, 8192]})
    with pytest.raises(InvalidRequestError) as info:
        params.validate_vocab(8192)
    assert (info.value.field, info.value.value) == (field, 8192)
    assert "8192" in info.value.limit


# -------------------------------------------------------------- offline LLM

PROMPT = "def main():\n"


def _model_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=128, max_model_len=64)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_model_path()))


def _greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **fields)


def _run(llm: LLM, params: SamplingParams, prompt: Any = PROMPT) -> Any:
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _contains(token_ids: list[int], sequence: list[int]) -> bool:
    return any(token_ids[i : i + len(sequence)] == sequence for i in range(len(token_ids) - len(sequence) + 1))


def test_bad_words_keep_words_the_greedy_model_writes_out_of_the_output(llm: LLM, tokenizer: Any) -> None:
    plain = list(_run(llm, _greedy()).outputs[0].token_ids)
    # One word the model writes as one token, one it writes as two (its 3rd and 4th tokens).
    one_token = tokenizer.decode(plain[:1]).strip()
    two_tokens = tokenizer.decode(plain[2:4]).strip()
    for word in (one_token, two_tokens):
        sequences = bad_words_token_ids(tokenizer, [word], 8192)
        assert any(_contains(plain, sequence) for sequence in sequences), (word, sequences)
        banned = list(_run(llm, _greedy(bad_words=[word])).outputs[0].token_ids)
        assert banned != plain
        assert not any(_contains(banned, sequence) for sequence in sequences), (word, banned)
    # Before the banned word the run is the unbanned one.
    assert list(_run(llm, _greedy(bad_words=[two_tokens])).outputs[0].token_ids)[:3] == plain[:3]


def test_every_token_is_the_best_allowed_one_by_its_raw_logprobs(llm: LLM) -> None:
    allowed = [13, 100, 882, 2754, 4005, 7000]
    output = _run(llm, _greedy(allowed_token_ids=allowed, logprob_token_ids=allowed)).outputs[0]
    assert set(output.token_ids) <= set(allowed)
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert set(entry) == set(allowed)
        assert token_id == max(allowed, key=lambda t: entry[t].logprob)
    seeded = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    for sample in _run(llm, seeded).outputs:
        assert set(sample.token_ids) <= set(allowed)


def test_logprob_token_ids_equal_hf_log_softmax_at_those_ids(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    ids = [5, 882, 4005, 8191]
    output = _run(llm, SamplingParams(temperature=1.0, seed=7, max_tokens=5, logprob_token_ids=ids))
    completion = output.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(str(_model_path()), dtype=torch.float32).eval()
    all_ids = list(output.prompt_token_ids) + list(completion.token_ids)
    with torch.inference_mode():
        reference = model(torch.tensor([all_ids])).logits[0].float().log_softmax(dim=-1)
    start = len(output.prompt_token_ids) - 1
    for position, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert set(entry) == set(ids) | {token_id}
        for logprob_id in ids:
            assert entry[logprob_id].logprob == pytest.approx(reference[start + position, logprob_id].item(), abs=1e-4)
        assert entry[token_id].logprob == pytest.approx(reference[start + position, token_id].item(), abs=1e-4)


@pytest.mark.parametrize(("k", "side"), [(5, "left"), (5, "right"), (-1, "left")])
def test_truncate_prompt_tokens_answers_as_the_truncated_prompt(llm: LLM, k: int, side: str) -> None:
    prompt_ids = [(7 * i + 3) % 8000 + 10 for i in range(80)]  # longer than max_model_len (64)
    kept = 63 if k == -1 else k
    expected_ids = prompt_ids[:kept] if side == "right" else prompt_ids[-kept:]
    max_tokens = 1 if k == -1 else 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, truncate_prompt_tokens=k,
                            truncation_side=side)
    truncated = _run(llm, params, {"prompt_token_ids": prompt_ids})
    reference = _run(llm, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                     {"prompt_token_ids": expected_ids})
    assert list(truncated.prompt_token_ids) == expected_ids
    assert list(truncated.outputs[0].token_ids) == list(reference.outputs[0].token_ids)


def test_truncate_prompt_tokens_at_the_context_length_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _run(llm, SamplingParams(truncate_prompt_tokens=64), PROMPT)
    assert info.value.field == "truncate_prompt_tokens"
    assert "max_model_len (64)" in info.value.limit


# policy always: draft counts are compared across runs (the default policy follows measured times).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "policy": "always"}


def test_speculative_decoding_verifies_drafts_under_the_token_controls(llm: LLM, tokenizer: Any) -> None:
    spec_llm = LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=128, max_model_len=64,
                   speculative_config=NGRAM)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]}
    plain = list(_run(llm, _greedy(), prompt).outputs[0].token_ids)
    stats = spec_llm.engine_core.engine_core.scheduler.total_spec_decoding_stats
    for params in [
        _greedy(bad_words=[tokenizer.decode(plain[1:3]).strip()]),
        # A repeating allowed set: n-gram lookup drafts it, so drafts are verified under the mask.
        _greedy(allowed_token_ids=[11, 12, 13, 14], logprob_token_ids=[11, 13]),
        # Unbanned, the output cycles 12, 14 and n-gram drafts follow it: a draft
        # 12 must ban 14 at the next verified position.
        _greedy(allowed_token_ids=[11, 12, 13, 14], bad_words_token_ids=[[12, 14]]),
    ]:
        accepted_before = stats.num_accepted_tokens
        reference = _run(llm, params, prompt).outputs[0]
        speculative = _run(spec_llm, params, prompt).outputs[0]
        assert list(speculative.token_ids) == list(reference.token_ids)
        assert not _contains(list(speculative.token_ids), [12, 14]) or params.bad_words_token_ids is None
        for got, expected in zip(speculative.logprobs or [], reference.logprobs or [], strict=True):
            assert {t: e.logprob for t, e in got.items()} == pytest.approx({t: e.logprob for t, e in expected.items()},
                                                                          abs=1e-4)
    assert stats.num_accepted_tokens > accepted_before
