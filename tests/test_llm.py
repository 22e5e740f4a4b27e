"""The offline API end to end: `LLM.generate` / `LLM.chat` on a tiny random Llama.

Every expected value comes from a reference computed in the same run: Hugging
Face transformers (float32) for tokens and log-probabilities, the tokenizer for
prompts and text, and a first greedy run of the engine for the stop tests.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import InvalidRequestError

NUM_KV_BLOCKS = 256
BLOCK_SIZE = 16
ATOL = 1e-4
# Long enough for two full blocks (a prefix hit covers at most prompt_len - 1 tokens).
LONG_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n"
)


@pytest.fixture(autouse=True)
def _check_block_invariant_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_DEBUG_KV", "1")


def _model_path():
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


@pytest.fixture
def llm() -> LLM:
    return LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_model_path()))


_hf_models: dict[str, torch.nn.Module] = {}


def _hf_model(path: Path | None = None) -> torch.nn.Module:
    key = str(path or _model_path())
    if key not in _hf_models:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        _hf_models[key] = model.eval()
    return _hf_models[key]


def hf_greedy(prompt: list[int], max_new_tokens: int, *, path: Path | None = None, **generate_kwargs: Any) -> list[int]:
    """HF greedy continuation (float32, KV cache); never stops at EOS unless told."""
    kwargs: dict[str, Any] = dict(eos_token_id=None, min_new_tokens=max_new_tokens)
    kwargs.update(generate_kwargs)
    with torch.inference_mode():
        output = _hf_model(path).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return output[0, len(prompt) :].tolist()


def hf_log_softmax(token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row p is log_softmax of HF's raw logits at position p (scores token p + 1)."""
    with torch.inference_mode():
        logits = _hf_model()(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def _greedy(max_tokens: int = 8, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def _engine(llm: LLM):
    return llm.engine_core.engine_core


def _assert_all_freed(llm: LLM) -> None:
    core = _engine(llm)
    assert not core.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS
    core.check_invariants()


def _assert_position_logprobs(entry: dict, chosen: int, ref_row: torch.Tensor, k: int, tokenizer: Any) -> None:
    """One position's dict: the chosen token plus the top-k, values and ranks as HF's."""
    assert chosen in entry
    for token_id, logprob in entry.items():
        ref = ref_row[token_id].item()
        assert logprob.logprob == pytest.approx(ref, abs=ATOL), token_id
        # Rank as vLLM: 1 + how many tokens are more likely (ties within ATOL tolerated).
        lowest = int((ref_row > ref + ATOL).sum()) + 1
        highest = int((ref_row >= ref - ATOL).sum())
        assert lowest <= logprob.rank <= highest, (token_id, logprob.rank, lowest, highest)
        assert logprob.decoded_token == tokenizer.decode([token_id])
    chosen_rank = entry[chosen].rank
    assert {lp.rank for lp in entry.values()} == set(range(1, k + 1)) | {chosen_rank}
    assert len(entry) == k + (1 if chosen_rank > k else 0)
    top_values = sorted((lp.logprob for lp in entry.values() if lp.rank <= k), reverse=True)
    assert top_values == pytest.approx(ref_row.topk(k).values.tolist(), abs=ATOL)


# ---------------------------------------------------------------- prompts


def test_generate_accepts_every_prompt_form_in_input_order(llm: LLM, tokenizer: Any) -> None:
    texts = ["Hello world, this is", "def foo(x):", "import os", "class Bar:", "while True:"]
    ids_prompt = tokenizer.encode("return None")
    prompts = [
        texts[0],
        ids_prompt,
        {"prompt": texts[1]},
        {"prompt_token_ids": tokenizer.encode(texts[2])},
        {"prompt": texts[3], "cache_salt": "salt-1"},
        {"prompt_token_ids": tokenizer.encode(texts[4]), "cache_salt": "salt-2"},
    ]
    expected = [
        (texts[0], tokenizer.encode(texts[0])),
        (None, ids_prompt),
        (texts[1], tokenizer.encode(texts[1])),
        (None, tokenizer.encode(texts[2])),
        (texts[3], tokenizer.encode(texts[3])),
        (None, tokenizer.encode(texts[4])),
    ]
    outputs = llm.generate(prompts, _greedy(6), use_tqdm=False)

    assert len(outputs) == len(prompts)
    assert len({output.request_id for output in outputs}) == len(prompts)
    for output, (text, token_ids) in zip(outputs, expected, strict=True):
        assert isinstance(output.request_id, str)
        assert output.finished
        assert output.prompt == text
        assert output.prompt_token_ids == token_ids
        assert len(output.outputs) == 1
        # The continuation is the one of *this* prompt: order is kept.
        assert output.outputs[0].token_ids == hf_greedy(token_ids, 6)
        assert output.outputs[0].finish_reason == "length"

    # A single prompt (text, token ids or dict) is one output, not a batch.
    for single in (texts[0], ids_prompt, {"prompt": texts[0]}):
        (output,) = llm.generate(single, _greedy(2), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 2
    _assert_all_freed(llm)


def test_list_of_sampling_params_is_honoured_per_prompt(llm: LLM, tokenizer: Any) -> None:
    prompts = ["import sys", "print(", "x = [1, 2"]
    params = [_greedy(3), _greedy(7), SamplingParams(temperature=1.0, top_k=1, max_tokens=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, prompt, num_tokens in zip(outputs, prompts, [3, 7, 5], strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tokenizer.encode(prompt), num_tokens)


def test_sampling_params_count_mismatch_is_an_invalid_request(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate(["a", "b", "c"], [_greedy(), _greedy()], use_tqdm=False)
    assert excinfo.value.field == "sampling_params"
    _assert_all_freed(llm)


# --------------------------------------------------------------- logprobs


def test_logprobs_equal_hf_log_softmax_with_ranks_and_cumulative_sum(llm: LLM, tokenizer: Any) -> None:
    prompts = ["def main():\n", "The quick brown fox", "import numpy as np"]
    params = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=5, ignore_eos=True),
        _greedy(6, logprobs=2),
        SamplingParams(temperature=1.0, seed=12, max_tokens=6, logprobs=0, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, param in zip(outputs, params, strict=True):
        completion = output.outputs[0]
        prompt_ids = output.prompt_token_ids
        ref = hf_log_softmax(prompt_ids + completion.token_ids)
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            _assert_position_logprobs(entry, token_id, ref[len(prompt_ids) - 1 + i], param.logprobs, tokenizer)
        chosen = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
        assert completion.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-5)
        ref_chosen = [ref[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(sum(ref_chosen), abs=1e-3)
    # The greedy request picks the top token everywhere.
    greedy = outputs[1].outputs[0]
    assert all(entry[t].rank == 1 for t, entry in zip(greedy.token_ids, greedy.logprobs, strict=True))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16], ids=["one-chunk", "chunked-prefill"])
def test_prompt_logprobs_equal_hf_and_skip_the_prefix_cache(
    max_num_batched_tokens: int | None, tokenizer: Any
) -> None:
    extra = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    llm = LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, **extra)
    prompt_ids = tokenizer.encode(LONG_TEXT)[:40]
    expected_hit = (len(prompt_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_hit == 32

    (first,) = llm.generate({"prompt_token_ids": prompt_ids}, _greedy(2), use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert first.prompt_logprobs is None

    (output,) = llm.generate({"prompt_token_ids": prompt_ids}, _greedy(2, prompt_logprobs=3), use_tqdm=False)
    assert output.num_cached_tokens == 0  # the cached prompt was there, but not used
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None
    ref = hf_log_softmax(prompt_ids)
    for position in range(1, len(prompt_ids)):
        _assert_position_logprobs(prompt_logprobs[position], prompt_ids[position], ref[position - 1], 3, tokenizer)
    assert output.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(prompt_ids, 2)

    (again,) = llm.generate({"prompt_token_ids": prompt_ids}, _greedy(2), use_tqdm=False)
    assert again.num_cached_tokens == expected_hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_all_freed(llm)


# ---------------------------------------------------------------- n > 1


def test_n_samples_are_one_output_reproducible_and_share_prompt_blocks(llm: LLM, tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode(LONG_TEXT)[:40]
    num_full_prompt_blocks = len(prompt_ids) // BLOCK_SIZE
    core = _engine(llm)
    step = core.step
    block_tables_after_first_step: list[dict[str, list[int]]] = []

    def recording_step():
        outputs = step()
        if len(block_tables_after_first_step) < 1:
            block_tables_after_first_step.append(
                {req_id: list(core.kv_cache_manager.get_block_ids(req_id)) for req_id in core.scheduler.requests}
            )
        return outputs

    core.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)

    assert [completion.index for completion in output.outputs] == [0, 1, 2]
    assert all(len(completion.token_ids) == 8 for completion in output.outputs)
    assert output.prompt_token_ids == prompt_ids
    samples = [tuple(completion.token_ids) for completion in output.outputs]
    assert len(set(samples)) == 3, "seeded siblings must not repeat each other"

    (tables,) = block_tables_after_first_step
    assert len(tables) == 3, tables  # the three children, all scheduled in the first step
    prompt_blocks = {tuple(table[:num_full_prompt_blocks]) for table in tables.values()}
    assert len(prompt_blocks) == 1, f"siblings do not share their full prompt blocks: {tables}"
    assert len({table[num_full_prompt_blocks] for table in tables.values()}) == 3  # partial blocks are private

    core.step = step  # type: ignore[method-assign]
    (again,) = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)
    assert [tuple(completion.token_ids) for completion in again.outputs] == samples
    _assert_all_freed(llm)


# ------------------------------------------------------------- sampling


def test_seeded_request_gets_the_same_tokens_whatever_the_batch(llm: LLM) -> None:
    target_prompt = "for i in range(3):"
    target = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate(target_prompt, target, use_tqdm=False)
    expected = alone.outputs[0].token_ids

    others = ["import os", "x = 1\ny = 2\nz = x + y", "print('hello')"]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded_other = SamplingParams(temperature=0.8, seed=99, max_tokens=5, ignore_eos=True)
    batches = [
        ([others[0], target_prompt, others[1]], [unseeded, target, seeded_other]),
        ([others[1], others[2], others[0], target_prompt], [seeded_other, _greedy(3), unseeded, target]),
        ([target_prompt, others[2]], [target, unseeded]),
    ]
    for prompts, params in batches:
        llm.reset_prefix_cache()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert outputs[prompts.index(target_prompt)].outputs[0].token_ids == expected

    (other_seed,) = llm.generate(
        target_prompt, SamplingParams(temperature=1.0, seed=4321, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert other_seed.outputs[0].token_ids != expected


def test_engine_seed_makes_unseeded_sampling_reproducible() -> None:
    prompts = ["import os", "def f(x):", "class A:"]
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        engine = LLM(model=str(_model_path()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, seed=seed)
        torch.manual_seed(seed + 1000)  # the global RNG must not matter
        return [list(o.outputs[0].token_ids) for o in engine.generate(prompts, unseeded, use_tqdm=False)]

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def test_temperature_zero_and_top_k_one_equal_hf_greedy(llm: LLM, tokenizer: Any) -> None:
    prompts = ["def add(a, b):", "The answer is", "if __name__ == '__main__':"]
    greedy = llm.generate(prompts, _greedy(10), use_tqdm=False)
    top_k_one = llm.generate(
        prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for prompt, a, b in zip(prompts, greedy, top_k_one, strict=True):
        expected = hf_greedy(tokenizer.encode(prompt), 10)
        assert a.outputs[0].token_ids == expected
        assert b.outputs[0].token_ids == expected


# ------------------------------------------------------------ stopping


def _pick_stop_string(text: str) -> str:
    """Three plain characters from the middle of `text`."""
    for start in range(len(text) // 3, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.isprintable() and "\ufffd" not in candidate and candidate.strip():
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_the_text_before_it(llm: LLM, tokenizer: Any) -> None:
    prompt = "def greet(name):"
    (reference,) = llm.generate(prompt, _greedy(24), use_tqdm=False)
    full_text = reference.outputs[0].text
    full_tokens = reference.outputs[0].token_ids
    stop = _pick_stop_string(full_text)
    position = full_text.find(stop)
    # The stop string is complete once the first j tokens are decoded.
    num_tokens = next(j for j in range(1, len(full_tokens) + 1) if stop in tokenizer.decode(full_tokens[:j]))

    (excluded,) = llm.generate(prompt, _greedy(24, stop=[stop]), use_tqdm=False)
    completion = excluded.outputs[0]
    assert completion.text == full_text[:position]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.token_ids == full_tokens[:num_tokens]

    (included,) = llm.generate(prompt, _greedy(24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    completion = included.outputs[0]
    assert completion.text == full_text[: position + len(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == full_tokens[:num_tokens]
    _assert_all_freed(llm)  # the request a stop string ended was aborted in the core


def test_stop_token_id_ends_with_that_token(llm: LLM, tokenizer: Any) -> None:
    prompt = "class Node:"
    (reference,) = llm.generate(prompt, _greedy(16), use_tqdm=False)
    full_tokens = reference.outputs[0].token_ids
    stop_token = full_tokens[4]
    first = full_tokens.index(stop_token)

    (output,) = llm.generate(prompt, _greedy(16, stop_token_ids=[stop_token]), use_tqdm=False)
    completion = output.outputs[0]
    assert completion.token_ids == full_tokens[: first + 1]  # the stop token is in token_ids
    assert completion.text == tokenizer.decode(full_tokens[:first], skip_special_tokens=True)  # not in text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    _assert_all_freed(llm)


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    (output,) = llm.generate("while x:", _greedy(5), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("length", None)


def test_min_tokens_holds_back_a_stop_token_as_hf_min_new_tokens(llm: LLM, tokenizer: Any) -> None:
    prompt = "try:\n    import json"
    prompt_ids = tokenizer.encode(prompt)
    greedy_tokens = hf_greedy(prompt_ids, 32)
    # A stop token the plain greedy run emits early and, once it is masked
    # until min_tokens, the HF reference still emits later: both paths are used.
    for stop_token in greedy_tokens[:8]:
        min_tokens = greedy_tokens.index(stop_token) + 2
        expected = hf_greedy(prompt_ids, 32, min_new_tokens=min_tokens, eos_token_id=stop_token)
        if expected[-1] == stop_token and len(expected) < 32:
            break
    else:
        pytest.fail(f"no stop token of {greedy_tokens[:8]} is emitted again after min_tokens; pick another prompt")

    (output,) = llm.generate(
        prompt, _greedy(32, stop_token_ids=[stop_token], min_tokens=min_tokens), use_tqdm=False
    )
    completion = output.outputs[0]
    assert completion.token_ids == expected
    assert stop_token not in completion.token_ids[:min_tokens]
    assert len(completion.token_ids) > min_tokens
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)


# ----------------------------------------------------------------- chat


def _chat_template_ids(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def test_chat_renders_the_tokenizer_template_for_one_and_many_conversations(llm: LLM, tokenizer: Any) -> None:
    conversation = [{"role": "user", "content": "Hello, who are you?"}]
    (output,) = llm.chat(conversation, _greedy(6), use_tqdm=False)
    expected_ids = _chat_template_ids(tokenizer, conversation)
    assert output.prompt_token_ids == expected_ids
    assert output.prompt == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert output.outputs[0].token_ids == hf_greedy(expected_ids, 6)

    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sum 2 and 3"}],
        conversation,
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and now?"},
        ],
    ]
    outputs = llm.chat(conversations, _greedy(4), use_tqdm=False)
    assert len(outputs) == 3
    for output, conv in zip(outputs, conversations, strict=True):
        expected_ids = _chat_template_ids(tokenizer, conv)
        assert output.prompt_token_ids == expected_ids
        assert output.outputs[0].token_ids == hf_greedy(expected_ids, 4)
    _assert_all_freed(llm)


# ------------------------------------------------------------ cache salt


def test_cache_salt_separates_prefix_cache_hits(llm: LLM) -> None:
    expected_hit = (len(llm.get_tokenizer().encode(LONG_TEXT)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_hit >= 32

    def cached(prompt: Any) -> int:
        (output,) = llm.generate(prompt, _greedy(1), use_tqdm=False)
        return output.num_cached_tokens

    assert cached({"prompt": LONG_TEXT, "cache_salt": "alice"}) == 0
    assert cached({"prompt": LONG_TEXT, "cache_salt": "alice"}) == expected_hit
    assert cached({"prompt": LONG_TEXT, "cache_salt": "bob"}) == 0
    assert cached(LONG_TEXT) == 0  # no salt is yet another chain
    assert cached(LONG_TEXT) == expected_hit
    assert cached({"prompt": LONG_TEXT, "cache_salt": "bob"}) == expected_hit


# ---------------------------------------------------------------- errors


def _long_prompt(num_tokens: int) -> list[int]:
    return [10 + i % 500 for i in range(num_tokens)]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", None, "prompt"),
        ({"prompt_token_ids": []}, None, "prompt"),
        (_long_prompt(512), None, "prompt"),  # >= max_model_len (512)
        (_long_prompt(600), None, "prompt"),
        ({"prompt_token_ids": [12, 8192]}, None, "prompt_token_ids"),  # vocab is 8192
        ({"prompt_token_ids": [12, -1]}, None, "prompt_token_ids"),
        ({"prompt_token_ids": [12, "x"]}, None, "prompt_token_ids"),
        ({"prompt": "hi", "salt": "x"}, None, "prompt"),
        (_long_prompt(500), SamplingParams(max_tokens=13), "max_tokens"),  # 512 - 500 = 12 left
    ],
    ids=[
        "empty-text",
        "empty-ids",
        "prompt-at-max-model-len",
        "prompt-over-max-model-len",
        "id-over-vocab",
        "negative-id",
        "non-int-id",
        "unknown-dict-key",
        "max-tokens-over-context",
    ],
)
def test_invalid_prompt_is_an_invalid_request_with_its_field(
    llm: LLM, prompt: Any, params: SamplingParams | None, field: str
) -> None:
    assert llm.max_model_len == 512
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate(prompt, params, use_tqdm=False)
    assert excinfo.value.field == field


@pytest.mark.parametrize(
    ("params", "priority", "field"),
    [
        (SamplingParams(stop_token_ids=[8192]), None, "stop_token_ids"),
        (SamplingParams(logit_bias={8192: 1.0}), None, "logit_bias"),
        (None, [2**63], "priority"),
        (None, [-(2**63) - 1], "priority"),
        (None, [10**5000], "priority"),
    ],
    ids=["stop-token-id-past-vocab", "logit-bias-key-past-vocab", "priority-int64-max-plus-1",
         "priority-int64-min-minus-1", "priority-5000-digits"],
)
def test_out_of_range_ids_and_priorities_are_refused_before_the_engine(
    llm: LLM, params: SamplingParams | None, priority: list[int] | None, field: str
) -> None:
    assert llm.engine_core.engine_core.vocab_size == 8192
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.generate(["def a():", "def b():"], params, priority=priority and priority * 2, use_tqdm=False)
    assert excinfo.value.field == field
    assert len(str(excinfo.value)) < 200
    _assert_all_freed(llm)
    # The int64 extremes themselves are fine.
    outputs = llm.generate(["def a():", "def b():"], _greedy(2), priority=[2**63 - 1, -(2**63)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]


def test_max_tokens_up_to_the_context_left_is_accepted(llm: LLM) -> None:
    (exact,) = llm.generate({"prompt_token_ids": _long_prompt(509)}, _greedy(3), use_tqdm=False)
    assert len(exact.outputs[0].token_ids) == 3
    # max_tokens=None means "until the context is full".
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (output,) = llm.generate({"prompt_token_ids": _long_prompt(505)}, unbounded, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == llm.max_model_len - 505
    assert output.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
    ids=lambda value: "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value,
)
def test_bad_sampling_params_are_invalid_requests_with_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.field == field


def test_engine_is_usable_after_a_failed_generate(llm: LLM, tokenizer: Any) -> None:
    good = "def ok():"
    with pytest.raises(InvalidRequestError) as excinfo:
        # The first prompt is accepted before the second is refused.
        llm.generate([good, {"prompt_token_ids": [5, 99999]}], _greedy(4), use_tqdm=False)
    assert excinfo.value.field == "prompt_token_ids"
    _assert_all_freed(llm)
    with pytest.raises(InvalidRequestError):
        llm.generate([good, good], [_greedy(4), SamplingParams(max_tokens=1000)], use_tqdm=False)
    _assert_all_freed(llm)

    outputs = llm.generate([good, "x = 3"], _greedy(4), use_tqdm=False)
    assert [output.outputs[0].token_ids for output in outputs] == [
        hf_greedy(tokenizer.encode(good), 4),
        hf_greedy(tokenizer.encode("x = 3"), 4),
    ]


# ------------------------------------------------------------- lifecycle


def test_engine_frees_every_block_and_resets_the_prefix_cache_when_idle(llm: LLM) -> None:
    core = _engine(llm)
    step = core.step
    reset_while_running: list[bool] = []

    def step_then_try_reset():
        outputs = step()
        if core.has_unfinished_requests():
            reset_while_running.append(llm.reset_prefix_cache())
        return outputs

    core.step = step_then_try_reset  # type: ignore[method-assign]
    prompts = [LONG_TEXT, "import re", {"prompt": LONG_TEXT, "cache_salt": "s"}]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
        _greedy(5, stop_token_ids=[0, 1]),
        _greedy(7, logprobs=1, prompt_logprobs=1),
    ]
    llm.generate(prompts, params, use_tqdm=False)
    core.step = step  # type: ignore[method-assign]
    assert reset_while_running and not any(reset_while_running)  # refused while blocks are in use
    _assert_all_freed(llm)

    (hit,) = llm.generate(LONG_TEXT, _greedy(1), use_tqdm=False)
    assert hit.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    (miss,) = llm.generate(LONG_TEXT, _greedy(1), use_tqdm=False)
    assert miss.num_cached_tokens == 0
    _assert_all_freed(llm)


# ------------------------------------------------------------------ text


def test_sampled_text_equals_tokenizer_decode_with_multibyte_prompts(llm: LLM, tokenizer: Any) -> None:
    prompts = ["héllo wörld — ünïcödé 日本語 🎉", "naïve café: ", "Ελληνικά και русский"]
    params = [
        SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=32, ignore_eos=True) for seed in (5, 6, 7)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    completions = [completion for output in outputs for completion in output.outputs]
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.prompt_token_ids == tokenizer.encode(prompt)
    for completion in completions:
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    # The check means more if some sampled token is a lone piece of a UTF-8 sequence.
    partial_pieces = [t for c in completions for t in c.token_ids if "\ufffd" in tokenizer.decode([t])]
    assert partial_pieces, "no sampled token was a partial UTF-8 sequence; pick other seeds"


MULTIBYTE_TEXT = "ǅӜ㐀𝄞"  # 2, 2, 3 and 4 UTF-8 bytes; no byte repeats; rare enough that
# the shipped tokenizer has no merge inside any of them


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, list[int]]:
    """The tiny Llama rewired so that greedy decoding cycles through the byte
    tokens of MULTIBYTE_TEXT: every layer's output projections are zeroed (the
    residual stream is the current token's embedding), each cycle token's
    embedding is a one-hot direction, and lm_head maps direction i to the next
    token of the cycle. Every multi-byte character is split across tokens."""
    from safetensors.torch import load_file, save_file

    cycle = tokenizer.encode(MULTIBYTE_TEXT)
    assert len(set(cycle)) == len(cycle), cycle
    assert all("\ufffd" in tokenizer.decode([token]) for token in cycle), "every token must be a partial character"
    path = tmp_path_factory.mktemp("cycling-llama")
    shutil.copytree(_model_path(), path, dirs_exist_ok=True)
    weights = load_file(str(path / "model.safetensors"))
    hidden_size = weights["model.embed_tokens.weight"].shape[1]
    for name in weights:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    for i, token in enumerate(cycle):
        direction = torch.zeros(hidden_size)
        direction[i] = 1.0
        weights["model.embed_tokens.weight"][token] = direction
        weights["lm_head.weight"][cycle[(i + 1) % len(cycle)]] += 10.0 * direction
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, cycle


def test_multibyte_characters_split_across_tokens_are_reassembled(
    cycling_model: tuple[Path, list[int]], tokenizer: Any
) -> None:
    path, cycle = cycling_model
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    num_cycles = 3
    outputs = llm.generate(
        [MULTIBYTE_TEXT] * 4,
        [
            _greedy(num_cycles * len(cycle)),
            _greedy(num_cycles * len(cycle) + 3),  # ends inside a character
            _greedy(num_cycles * len(cycle), stop=["㐀"]),
            _greedy(num_cycles * len(cycle), stop=["㐀"], include_stop_str_in_output=True),
        ],
        use_tqdm=False,
    )
    whole, cut, stopped, stopped_with = (output.outputs[0] for output in outputs)
    expected_tokens = hf_greedy(cycle, num_cycles * len(cycle) + 3, path=path)
    assert expected_tokens[: len(cycle)] == cycle  # the rewiring works in HF too

    assert whole.token_ids == expected_tokens[: num_cycles * len(cycle)]
    assert whole.text == MULTIBYTE_TEXT * num_cycles
    assert cut.token_ids == expected_tokens
    assert cut.text == tokenizer.decode(cut.token_ids, skip_special_tokens=True)

    num_tokens_to_stop = len(tokenizer.encode("ǅӜ㐀"))
    for completion, text in [(stopped, "ǅӜ"), (stopped_with, "ǅӜ㐀")]:
        assert completion.text == text
        assert (completion.finish_reason, completion.stop_reason) == ("stop", "㐀")
        assert completion.token_ids == cycle[:num_tokens_to_stop]
    _assert_all_freed(llm)
