from __future__ import annotations

import json
import math

import pytest

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import INT64_MAX, INT64_MIN, check_priority, short_value
from pagedllm.core.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SamplingParams,
    SamplingType,
)
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.wire import (
    AddRequests,
    CoreInputDecoder,
    CoreInputEncoder,
    from_engine_core_request,
)

VOCAB_SIZE = 16  # below MAX_LOGPROBS, so logprobs can exceed it


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


# ------------------------------------------------------- integer ranges (issue 13)

HUGE = 10**5000  # more digits than Python will even turn into text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": MAX_N + 1}, "n"),
        ({"n": 10**30}, "n"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"seed": HUGE}, "seed"),
        ({"max_tokens": INT64_MAX + 1}, "max_tokens"),
        ({"max_tokens": None, "min_tokens": INT64_MAX + 1}, "min_tokens"),
        ({"top_k": INT64_MAX + 1}, "top_k"),
        ({"top_k": -HUGE}, "top_k"),
        ({"logprobs": 10**30}, "logprobs"),
        ({"prompt_logprobs": HUGE}, "prompt_logprobs"),
        ({"stop_token_ids": [1, INT64_MAX + 1]}, "stop_token_ids"),
        ({"stop_token_ids": [HUGE]}, "stop_token_ids"),
        ({"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["ok", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"temperature": HUGE}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"repetition_penalty": MAX_REPETITION_PENALTY * 2}, "repetition_penalty"),
        ({"presence_penalty": -HUGE}, "presence_penalty"),
        ({"logit_bias": {INT64_MAX + 1: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {HUGE: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, "logit_bias"),
        ({"logit_bias": {5: HUGE}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)}, "logit_bias"),
    ],
    ids=lambda value: _case_id(value),
)
def test_out_of_range_values_name_their_field_in_a_short_message(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    # The value is echoed shortened: never thousands of digits.
    assert len(str(info.value)) < 200


def _case_id(value: object) -> str:
    if not isinstance(value, dict):
        return str(value)
    return "-".join(f"{k}={short_value(v, 24)}" for k, v in value.items())


def test_int64_extremes_are_accepted() -> None:
    p = SamplingParams(n=MAX_N, seed=INT64_MAX, max_tokens=INT64_MAX, min_tokens=INT64_MAX, top_k=INT64_MAX,
                       stop_token_ids=[0, INT64_MAX], logit_bias={0: -100, INT64_MAX: 100.0})
    assert (p.n, p.seed, p.max_tokens, p.top_k) == (MAX_N, INT64_MAX, INT64_MAX, INT64_MAX)
    assert p.logit_bias == {0: -100.0, INT64_MAX: 100.0}
    assert all(type(bias) is float for bias in p.logit_bias.values())
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    assert SamplingParams(logit_bias={}).logit_bias is None
    longest = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                             stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    assert (len(longest.stop), len(longest.stop_token_ids)) == (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS)


def test_children_seeds_wrap_around_inside_int64() -> None:
    p = SamplingParams(n=3, seed=INT64_MAX - 1)
    children = [p.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]
    # Each child is itself valid (it is rebuilt from the wire in the engine core).
    assert [SamplingParams(seed=c.seed).seed for c in children] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop_token_ids": [3, VOCAB_SIZE]}, "stop_token_ids"),
        ({"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
        ({"logprobs": VOCAB_SIZE + 1}, "logprobs"),
        ({"prompt_logprobs": VOCAB_SIZE + 1}, "prompt_logprobs"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_by_validate_against(kwargs: dict, field: str) -> None:
    params = SamplingParams(**kwargs)  # fine until the vocabulary is known
    with pytest.raises(InvalidRequestError) as info:
        params.validate_against(100, 10, vocab_size=VOCAB_SIZE)
    assert info.value.field == field
    assert str(VOCAB_SIZE) in info.value.limit


def test_token_ids_inside_the_vocabulary_are_accepted() -> None:
    params = SamplingParams(stop_token_ids=[0, VOCAB_SIZE - 1], logit_bias={VOCAB_SIZE - 1: 5}, logprobs=VOCAB_SIZE)
    assert params.validate_against(100, 10, vocab_size=VOCAB_SIZE) == 16


def test_short_value_never_spells_out_a_huge_int() -> None:
    assert short_value(12345) == 12345
    assert short_value("x" * 10) == "x" * 10
    assert short_value("x" * 100) == "x" * 77 + "..."
    assert short_value(HUGE) == "<integer of about 5001 digits>"
    assert short_value(-HUGE) == "<-integer of about 5001 digits>"
    assert short_value([HUGE]) == "<list too large to show>"
    assert short_value(10**100) == str(10**100)[:77] + "..."


@pytest.mark.parametrize("priority", [INT64_MAX + 1, INT64_MIN - 1, HUGE, 1.5, True, "1"],
                         ids=lambda value: repr(short_value(value, 24)))
def test_priority_outside_int64_is_refused(priority: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_priority(priority)
    assert info.value.field == "priority"
    assert len(str(info.value)) < 200
    assert check_priority(INT64_MIN) == INT64_MIN and check_priority(INT64_MAX) == INT64_MAX


def test_extreme_but_valid_values_cross_the_engine_wire() -> None:
    params = SamplingParams(n=1, seed=INT64_MAX, max_tokens=INT64_MAX, min_tokens=INT64_MAX, top_k=INT64_MAX,
                            stop_token_ids=[INT64_MAX], logit_bias={INT64_MAX: -100.0, 0: 100.0})
    encoder, decoder = CoreInputEncoder(), CoreInputDecoder()
    for priority in (INT64_MAX, INT64_MIN):
        request = make_request("r", None, [1, 2], params.for_child(1), 1.0, priority=priority, eos_token_id=2)
        message = decoder.decode(encoder.encode(AddRequests(request.engine_requests())))
        assert isinstance(message, AddRequests)
        rebuilt = from_engine_core_request(message.requests[0])
        assert rebuilt.priority == priority
        assert rebuilt.sampling_params == request.params
        assert rebuilt.sampling_params.seed == INT64_MIN  # INT64_MAX + 1 wrapped


@pytest.mark.parametrize("field", ["json", "structural_tag"])
def test_a_json_object_with_an_integer_past_64_bits_is_refused_by_name(field: str) -> None:
    """The dict travels to the engine core as it is, and the wire holds 64-bit
    integers: a wider one deep inside (a fuzzer's schema) is a 400 naming the
    field, not a 500; the same number as JSON text stays text and passes."""
    from pagedllm.core.sampling_params import StructuredOutputsParams

    spec = {"type": "object", "properties": {"a": [{"x": -1910233140948104118272}]}}
    with pytest.raises(InvalidRequestError, match=rf"structured_outputs.{field}=-1910233140948104118272 is invalid"):
        StructuredOutputsParams(**{field: spec})
    StructuredOutputsParams(**{field: {"type": "object", "maximum": (1 << 64) - 1, "minimum": -(1 << 63)}})
    StructuredOutputsParams(**{field: json.dumps(spec)})
