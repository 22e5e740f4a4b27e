"""Every field vLLM's OpenAI protocol accepts on /v1/completions and
/v1/chat/completions is implemented (in the OpenAPI schema), a 400 naming it
when it would change the answer (left out of the schema; its do-nothing
value, such as `use_beam_search: false`, is accepted), or bookkeeping that
changes nothing (`user`, `metadata`): never silently ignored.

The reference lists are the fields of vLLM's CompletionRequest and
ChatCompletionRequest (entrypoints/openai/protocol.py, v0.9 to v0.12), and
vLLM 0.32's, snapshotted from its pydantic models in
data/vllm_request_fields.json.
The server half checks the same through the live app: the new token
controls act, the refusals and `best_of` agree with /openapi.json.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_server
from helpers.tiny_models import cached_tiny_model
from pydantic import BaseModel, ValidationError

from pagedllm.core.errors import InvalidRequestError
from pagedllm.entrypoints.openai.errors import describe_validation_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.unsupported import (
    IGNORED_FIELDS,
    UNSUPPORTED_CHAT_FIELDS,
    VLLM_REFUSED_CHAT_FIELDS,
    VLLM_REFUSED_COMPLETION_FIELDS,
    VLLM_REFUSED_FIELDS,
)

VLLM_SHARED = (
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words",
    "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget", "best_of",
)
VLLM_COMPLETION = (*VLLM_SHARED, "prompt", "echo", "suffix", "prompt_embeds", "return_token_offsets")
VLLM_CHAT = (
    *VLLM_SHARED, "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "echo", "add_generation_prompt", "continue_final_message",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
    "structural_tag",
)
CMPL: dict[str, Any] = {"prompt": "hi"}
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
ROUTES = [(CompletionRequest, CMPL, VLLM_COMPLETION, {**VLLM_REFUSED_FIELDS, **VLLM_REFUSED_COMPLETION_FIELDS}),
          (ChatCompletionRequest, CHAT, VLLM_CHAT, {**VLLM_REFUSED_FIELDS, **VLLM_REFUSED_CHAT_FIELDS})]


def _changing_value(no_op_values: tuple[Any, ...]) -> Any:
    """A value of the field that would change the answer."""
    for no_op in no_op_values:
        if isinstance(no_op, bool):
            return not no_op
        if isinstance(no_op, (int, float)):
            return no_op + 2
    return "x"


def _refusal(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return describe_validation_error(info.value.errors())


@pytest.mark.parametrize(("model", "base", "vllm_fields", "refused"), ROUTES, ids=["completions", "chat"])
def test_every_vllm_field_is_served_refused_or_bookkeeping(
    model: type[BaseModel], base: dict[str, Any], vllm_fields: tuple[str, ...], refused: dict[str, tuple[Any, ...]]
) -> None:
    served = set(model.model_json_schema()["properties"])
    unaccounted = [f for f in vllm_fields if f not in served and f not in refused and f not in IGNORED_FIELDS
                   and f not in UNSUPPORTED_CHAT_FIELDS and f != "best_of"]
    assert not unaccounted
    for field, no_op_values in refused.items():
        assert field not in served, field  # the schema lists what is served
        message, param = _refusal(model, {**base, field: _changing_value(no_op_values)})
        assert param == field and "not supported" in message, (field, message)
        for no_op in (None, *no_op_values):
            model.model_validate({**base, field: no_op})


VLLM_SNAPSHOT = json.loads((Path(__file__).parent / "data" / "vllm_request_fields.json").read_text())


@pytest.mark.parametrize(("model", "base", "refused"), [(m, b, r) for m, b, _, r in ROUTES],
                         ids=["completions", "chat"])
def test_every_field_of_vllm_0_32_is_served_refused_or_bookkeeping(
    model: type[BaseModel], base: dict[str, Any], refused: dict[str, tuple[Any, ...]]
) -> None:
    assert VLLM_SNAPSHOT["vllm_version"] == "0.32.0"
    served = set(model.model_json_schema()["properties"])
    accounted = served | set(refused) | set(IGNORED_FIELDS) | set(UNSUPPORTED_CHAT_FIELDS)
    assert sorted(set(VLLM_SNAPSHOT[model.__name__]) - accounted) == []
    assert not served & set(refused)


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_guided_aliases_are_structured_outputs_and_one_constraint_per_request(model: type[BaseModel]) -> None:
    base = CMPL if model is CompletionRequest else CHAT
    schema = {"type": "object"}
    for alias, value, key in [("guided_json", schema, "json"), ("guided_regex", "[a-z]+", "regex"),
                              ("guided_choice", ["a", "b"], "choice"), ("guided_grammar", 'root ::= "a"', "grammar")]:
        via_alias = model.model_validate({**base, alias: value, "guided_decoding_backend": "guidance"})
        direct = model.model_validate({**base, "structured_outputs": {key: value, "backend": "guidance"}})
        assert via_alias.structured_outputs_params() == direct.structured_outputs_params()  # type: ignore[attr-defined]
    for extra, named, other in [({"structured_outputs": {"regex": "a"}}, "guided_json", "structured_outputs"),
                                ({"response_format": {"type": "json_object"}}, "guided_json", "response_format"),
                                ({"guided_choice": ["a"]}, "guided_choice", "guided_json")]:
        request = model.model_validate({**base, "guided_json": schema, **extra})
        with pytest.raises(InvalidRequestError) as info:
            request.structured_outputs_params()  # type: ignore[attr-defined]
        assert info.value.field == named and other in info.value.limit


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_new_token_controls_are_in_the_schema_with_their_bounds(model: type[BaseModel]) -> None:
    properties = model.model_json_schema()["properties"]
    assert properties["allowed_token_ids"]["anyOf"][0]["minItems"] == 1
    assert properties["logprob_token_ids"]["anyOf"][0]["maxItems"] == 20
    assert properties["bad_words"]["anyOf"][0]["maxItems"] == 128
    assert [s.get("const", s.get("minimum")) for s in properties["truncate_prompt_tokens"]["anyOf"][:2]] == [1, -1]
    assert "best_of" not in properties


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_best_of_other_than_n_is_refused_on_both_routes(model: type[BaseModel]) -> None:
    base = CMPL if model is CompletionRequest else CHAT
    request = model.model_validate({**base, "n": 2, "best_of": 3})
    with pytest.raises(Exception) as info:
        request.sampling_params(4, None, None)  # type: ignore[attr-defined]
    assert getattr(info.value, "field", None) == "best_of"
    model.model_validate({**base, "n": 2, "best_of": 2}).sampling_params(4, None, None)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ server

MODEL_NAME = "tiny-fields"
MAX_MODEL_LEN = 128


def _model_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with start_server(_model_path(), "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
                      "--served-model-name", MODEL_NAME) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_model_path()))


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def _completion(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": "def main():\n", "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, **fields}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def _chat(server: ServerProcess, **fields: Any) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0.0,
                                                  "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.slow
def test_server_applies_the_token_controls(server: ServerProcess, tokenizer: Any) -> None:
    plain = _completion(server, logprobs=0)["choices"][0]
    first_word = plain["logprobs"]["tokens"][0].strip()
    banned = _completion(server, bad_words=[first_word])["choices"][0]["text"]
    assert banned != plain["text"] and not banned.lstrip().startswith(first_word)

    allowed = [13, 100, 882, 2754]
    restricted = _completion(server, allowed_token_ids=allowed, logprob_token_ids=allowed)["choices"][0]
    assert set(restricted["logprobs"]["tokens"]) <= {tokenizer.decode([t]) for t in allowed}
    for token, top in zip(restricted["logprobs"]["tokens"], restricted["logprobs"]["top_logprobs"], strict=True):
        assert set(top) == {tokenizer.decode([t]) for t in allowed}
        assert token == max(top, key=top.__getitem__)  # the best allowed token by raw logprob

    plain_chat = _chat(server, logprobs=True)
    assert plain_chat.status_code == 200, plain_chat.text
    first_chat_word = plain_chat.json()["choices"][0]["logprobs"]["content"][0]["token"].strip()
    banned_chat = _chat(server, bad_words=[first_chat_word])
    assert banned_chat.status_code == 200, banned_chat.text
    banned_text = banned_chat.json()["choices"][0]["message"]["content"]
    assert banned_text != plain_chat.json()["choices"][0]["message"]["content"]
    assert not banned_text.lstrip().startswith(first_chat_word)

    chat = _chat(server, logprob_token_ids=[882, 5])
    assert chat.status_code == 200, chat.text
    for position in chat.json()["choices"][0]["logprobs"]["content"]:
        assert [top["token"] for top in position["top_logprobs"]] == [tokenizer.decode([882]), tokenizer.decode([5])]


@pytest.mark.slow
def test_server_truncates_the_prompt_as_if_the_truncated_prompt_were_sent(
    server: ServerProcess, tokenizer: Any
) -> None:
    prompt_ids = [(7 * i + 3) % 8000 + 10 for i in range(3 * MAX_MODEL_LEN)]
    prompt = tokenizer.decode(prompt_ids)
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    truncated = _completion(server, prompt=prompt, truncate_prompt_tokens=6, echo=True)
    reference = _completion(server, prompt=ids[-6:])
    assert truncated["usage"]["prompt_tokens"] == 6
    echoed = tokenizer.decode(ids[-6:])
    assert truncated["choices"][0]["text"] == echoed + reference["choices"][0]["text"]
    whole = _completion(server, prompt=prompt, truncate_prompt_tokens=-1, max_tokens=1)
    assert whole["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    chat = _chat(server, truncate_prompt_tokens=3)
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3


@pytest.mark.slow
def test_server_refusals_name_the_field_and_agree_with_the_schema(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    completion_fields = set(schema["components"]["schemas"]["CompletionRequest"]["properties"])
    assert {"allowed_token_ids", "bad_words", "logprob_token_ids", "truncate_prompt_tokens"} <= completion_fields
    assert {"guided_json", "guided_choice", "guided_decoding_backend"} <= completion_fields
    assert not completion_fields & {"best_of", "suffix", "use_beam_search", "guided_whitespace_pattern"}
    base = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    for body, param, words in [
        ({"allowed_token_ids": [3, 8192]}, "allowed_token_ids", ("8192", "vocabulary size is 8192")),
        ({"logprob_token_ids": [10**6]}, "logprob_token_ids", ("1000000", "8192")),
        ({"truncate_prompt_tokens": MAX_MODEL_LEN}, "truncate_prompt_tokens", (f"max_model_len ({MAX_MODEL_LEN})",)),
        ({"best_of": 2}, "best_of", ("n (1)",)),
        ({"use_beam_search": True}, "use_beam_search", ("not supported",)),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ("structured_outputs.max_whitespace",)),
        ({"suffix": "end"}, "suffix", ("not supported",)),
    ]:
        response = _post(server, "/v1/completions", {**base, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert all(word in error["message"] for word in words), (body, error)
    chat = _chat(server, allowed_token_ids=[8192])
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "allowed_token_ids"
    assert _chat(server, echo=True).json()["error"]["param"] == "echo"
    ok = _post(server, "/v1/completions", {**base, "best_of": 1, "use_beam_search": False, "length_penalty": 1})
    assert ok.status_code == 200, ok.text
