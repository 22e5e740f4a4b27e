from __future__ import annotations

import math

import pytest

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.ignore_eos) == (None, 16, 0, False)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.prompt_logprobs) == ([], [], None, None)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.detokenize) == (True, True, True)
    assert p.include_stop_str_in_output is False and p.structured_outputs is None and p.extra_args is None


def test_stop_and_stop_token_ids_are_normalized_to_lists() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9))
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert p.all_stop_token_ids == {7, 9}
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [1, -5]}, "stop_token_ids"),
        ({"seed": "42"}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_bad_values_raise_invalid_request_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                       logprobs=0, prompt_logprobs=MAX_LOGPROBS, max_tokens=None, min_tokens=5, seed=-3)
    assert p.max_tokens is None and p.logprobs == 0


def test_sampling_type_greedy_random_and_seeded() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=1).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=0).sampling_type == SamplingType.RANDOM_SEED


def test_greedy_resets_truncation_knobs() -> None:
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["x"], extra_args={"a": [1]})
    c = p.clone()
    c.stop.append("y")
    c.extra_args["a"].append(2)
    assert p.stop == ["x"] and p.extra_args == {"a": [1]}
    assert c == SamplingParams(stop=["x", "y"], extra_args={"a": [1, 2]})


def test_children_of_a_seeded_request_get_consecutive_seeds() -> None:
    p = SamplingParams(n=3, seed=10)
    assert [(c.n, c.seed) for c in (p.for_child(i) for i in range(3))] == [(1, 10), (1, 11), (1, 12)]
    assert SamplingParams(n=2).for_child(1).seed is None


def test_validate_against_context_left() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=9000).validate_against(8192, 812)
    assert str(info.value) == (
        "max_tokens=9000 is invalid: exceeds the context left for this prompt (8192 - 812 = 7380)"
    )
    assert SamplingParams(max_tokens=7380).validate_against(8192, 812) == 7380
    assert SamplingParams(max_tokens=None).validate_against(8192, 812) == 7380
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=None).validate_against(100, 100)
    assert info.value.field == "prompt"
