"""Every integer field of the request bodies has bounds (in the OpenAPI schema
too): a value past them is a 400 naming the field with a short message,
never an int that reaches msgpack, a tensor or a tokenizer. logit_bias keys
become ints; best_of other than n is refused, not ignored (and not in the schema)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import INT64_MAX, INT64_MIN
from pagedllm.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from pagedllm.entrypoints.openai.errors import describe_validation_error
from pagedllm.entrypoints.openai.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)

BEYOND = 10**30  # parses from JSON as a Python int, fits no machine integer
CMPL: dict[str, Any] = {"prompt": "hi"}
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


def _refusal(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return describe_validation_error(info.value.errors())


# (route body, field, bad value, param named, words the message holds)
CASES: list[tuple[type[BaseModel], dict[str, Any], str, Any, str, str]] = [
    (CompletionRequest, CMPL, "n", 0, "n", "must be >= 1"),
    (CompletionRequest, CMPL, "n", MAX_N + 1, "n", f"must be <= {MAX_N}"),
    (CompletionRequest, CMPL, "seed", INT64_MAX + 1, "seed", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "seed", -BEYOND, "seed", f"must be >= {INT64_MIN}"),
    (CompletionRequest, CMPL, "top_k", -2, "top_k", "must be >= -1"),
    (CompletionRequest, CMPL, "top_k", BEYOND, "top_k", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "min_tokens", -1, "min_tokens", "must be >= 0"),
    (CompletionRequest, CMPL, "min_tokens", BEYOND, "min_tokens", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "priority", INT64_MAX + 1, "priority", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "priority", INT64_MIN - 1, "priority", f"must be >= {INT64_MIN}"),
    (CompletionRequest, CMPL, "stop_token_ids", [1, BEYOND], "stop_token_ids.1", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "stop_token_ids", [-1], "stop_token_ids.0", "must be >= 0"),
    (CompletionRequest, CMPL, "stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1), "stop_token_ids",
     f"at most {MAX_STOP_TOKEN_IDS}"),
    (CompletionRequest, CMPL, "max_tokens", 0, "max_tokens", "must be >= 1"),
    (CompletionRequest, CMPL, "max_tokens", BEYOND, "max_tokens", f"must be <= {INT64_MAX}"),
    (CompletionRequest, CMPL, "logprobs", MAX_LOGPROBS + 1, "logprobs", f"must be <= {MAX_LOGPROBS}"),
    (CompletionRequest, CMPL, "logprobs", -1, "logprobs", "must be >= 0"),
    (CompletionRequest, CMPL, "prompt_logprobs", BEYOND, "prompt_logprobs", f"must be <= {MAX_LOGPROBS}"),
    (CompletionRequest, CMPL, "best_of", 0, "best_of", "must be >= 1"),
    (CompletionRequest, CMPL, "best_of", BEYOND, "best_of", f"must be <= {MAX_N}"),
    (CompletionRequest, CMPL, "logit_bias", {"5": 100.5}, "logit_bias.5", "must be <= 100"),
    (CompletionRequest, CMPL, "logit_bias", {"5": -BEYOND}, "logit_bias.5", "must be >= -100"),
    (CompletionRequest, CMPL, "logit_bias", {"5": float("nan")}, "logit_bias.5", "not NaN"),
    (CompletionRequest, CMPL, "logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}, "logit_bias",
     f"at most {MAX_LOGIT_BIAS_ENTRIES}"),
    (ChatCompletionRequest, CHAT, "n", BEYOND, "n", f"must be <= {MAX_N}"),
    (ChatCompletionRequest, CHAT, "seed", BEYOND, "seed", f"must be <= {INT64_MAX}"),
    (ChatCompletionRequest, CHAT, "priority", -BEYOND, "priority", f"must be >= {INT64_MIN}"),
    (ChatCompletionRequest, CHAT, "max_tokens", BEYOND, "max_tokens", f"must be <= {INT64_MAX}"),
    (ChatCompletionRequest, CHAT, "max_completion_tokens", 0, "max_completion_tokens", "must be >= 1"),
    (ChatCompletionRequest, CHAT, "max_completion_tokens", BEYOND, "max_completion_tokens",
     f"must be <= {INT64_MAX}"),
    (ChatCompletionRequest, CHAT, "top_logprobs", MAX_LOGPROBS + 1, "top_logprobs", f"must be <= {MAX_LOGPROBS}"),
    (ChatCompletionRequest, CHAT, "stop_token_ids", [BEYOND], "stop_token_ids.0", f"must be <= {INT64_MAX}"),
    (ChatCompletionRequest, CHAT, "logit_bias", {"7": 101}, "logit_bias.7", "must be <= 100"),
    (DetokenizeRequest, {}, "tokens", [BEYOND], "tokens.0", f"must be <= {INT64_MAX}"),
    (DetokenizeRequest, {}, "tokens", [-1], "tokens.0", "must be >= 0"),
]


@pytest.mark.parametrize(
    ("model", "base", "field", "value", "param", "words"), CASES,
    ids=[f"{case[0].__name__}-{case[2]}-{str(case[3])[:12]}" for case in CASES],
)
def test_integer_past_its_bound_is_refused_naming_the_field(
    model: type[BaseModel], base: dict[str, Any], field: str, value: Any, param: str, words: str
) -> None:
    message, named = _refusal(model, {**base, field: value})
    assert named == param
    assert message.startswith(f"{param}=")
    assert words in message
    assert len(message) < 200


@pytest.mark.parametrize(
    ("model", "field", "minimum", "maximum"),
    [
        (CompletionRequest, "n", 1, MAX_N),
        (CompletionRequest, "seed", INT64_MIN, INT64_MAX),
        (CompletionRequest, "priority", INT64_MIN, INT64_MAX),
        (CompletionRequest, "top_k", -1, INT64_MAX),
        (CompletionRequest, "min_tokens", 0, INT64_MAX),
        (CompletionRequest, "max_tokens", 1, INT64_MAX),
        (CompletionRequest, "logprobs", 0, MAX_LOGPROBS),
        (CompletionRequest, "prompt_logprobs", 0, MAX_LOGPROBS),
        (ChatCompletionRequest, "max_completion_tokens", 1, INT64_MAX),
        (ChatCompletionRequest, "top_logprobs", 0, MAX_LOGPROBS),
    ],
)
def test_openapi_schema_states_the_bounds(model: type[BaseModel], field: str, minimum: int, maximum: int) -> None:
    schema = model.model_json_schema()["properties"][field]
    integer = next(s for s in schema.get("anyOf", [schema]) if s.get("type") == "integer")
    assert (integer["minimum"], integer["maximum"]) == (minimum, maximum)


def test_openapi_schema_bounds_list_items_and_logit_bias() -> None:
    properties = CompletionRequest.model_json_schema()["properties"]
    items = properties["stop_token_ids"]["anyOf"][0]["items"]
    assert (items["minimum"], items["maximum"]) == (0, INT64_MAX)
    assert properties["stop_token_ids"]["anyOf"][0]["maxItems"] == MAX_STOP_TOKEN_IDS
    bias = properties["logit_bias"]["anyOf"][0]
    assert bias["maxProperties"] == MAX_LOGIT_BIAS_ENTRIES
    assert (bias["additionalProperties"]["minimum"], bias["additionalProperties"]["maximum"]) == (-100, 100)


def _params(model: type[BaseModel], **fields: Any) -> Any:
    request = model.model_validate({**(CMPL if model is CompletionRequest else CHAT), **fields})
    return request.sampling_params(16, None, None)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_logit_bias_keys_become_token_ids(model: type[BaseModel]) -> None:
    params = _params(model, logit_bias={"50256": -100, "0": 2.5, "007": 1})
    assert params.logit_bias == {50256: -100.0, 0: 2.5, 7: 1.0}


@pytest.mark.parametrize("key", ["abc", "-1", " 7", "+7", "1_0", "1.0", "٣", "", "9" * 20, "9" * 5000])
def test_logit_bias_key_that_is_not_a_token_id_is_refused(key: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _params(CompletionRequest, logit_bias={key: 1})
    assert info.value.field == "logit_bias"
    assert len(str(info.value)) < 200


def test_logit_bias_key_past_int64_is_refused_by_sampling_params() -> None:
    with pytest.raises(InvalidRequestError) as info:
        _params(CompletionRequest, logit_bias={str(INT64_MAX + 1): 1})
    assert info.value.field == "logit_bias"


@pytest.mark.parametrize(("n", "best_of"), [(1, 2), (3, 1), (2, 5)])
def test_best_of_other_than_n_is_refused(n: int, best_of: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _params(CompletionRequest, n=n, best_of=best_of)
    assert info.value.field == "best_of"
    assert "not supported" in info.value.limit and f"n ({n})" in info.value.limit


@pytest.mark.parametrize(("n", "best_of"), [(1, None), (1, 1), (4, 4)])
def test_best_of_omitted_or_equal_to_n_is_accepted(n: int, best_of: int | None) -> None:
    assert _params(CompletionRequest, n=n, best_of=best_of).n == n


def test_best_of_is_left_out_of_the_schema_which_cannot_say_equal_to_n() -> None:
    # The schema lists only what is served: best_of = n changes nothing, any
    # other value is refused, so a schema-valid body never has a refused best_of.
    assert "best_of" not in CompletionRequest.model_json_schema()["properties"]
