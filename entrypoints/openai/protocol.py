"""Request and response bodies of the OpenAI-compatible API (vLLM's shapes).

Requests are strict (no "10" for an int, no 1 for a bool) so a client bug is
a 400 naming the field instead of a silent conversion; unknown fields are
ignored, as OpenAI and vLLM do. Range checks live in SamplingParams, which
raises InvalidRequestError(field, value, limit) -> a 400 with `param`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import JsonDict, SkipJsonSchema
from pydantic_core import PydanticCustomError

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import INT64_MAX, INT64_MIN, short_value
from pagedllm.core.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    MAX_WHITESPACE,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedllm.engine.outputs import RequestOutputKind
from pagedllm.entrypoints.openai.guided_decoding import GuidedDecodingFields
from pagedllm.entrypoints.openai.surrogates import find_unpaired_surrogate
from pagedllm.entrypoints.openai.unsupported import (
    RefusedChatFields,
    RefusedCompletionFields,
    RefusedMessageFields,
    RefusedStreamOptions,
    RefusedVllmFields,
    check_content_parts,
)

# Most samples one request may ask for (OpenAI's limit); each is an engine request.
MAX_N = 128
# vLLM's `vllm_xargs` (SamplingParams.extra_args: the logits processors'
# per-request arguments): bounded like every other field.
MAX_XARGS = 64
MAX_XARG_STRING = 4096
MAX_XARG_LIST = 4096
XargScalar = (
    bool
    | Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
    | float
    | Annotated[str, Field(max_length=MAX_XARG_STRING)]
)
XargValue = XargScalar | Annotated[list[XargScalar], Field(max_length=MAX_XARG_LIST)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_unpaired_surrogates(cls, value: Any) -> Any:
        # NOTE: before any other validation, so no tokenizer, encoder or
        # grammar compiler ever sees a lone surrogate (JSON's "\ud800").
        found = find_unpaired_surrogate(value) if isinstance(value, (str, dict, list)) else None
        if found is not None:
            where, position = found
            raise PydanticCustomError(
                "unpaired_surrogate",
                "contains an unpaired UTF-16 surrogate at {where}character {position}; send valid Unicode text",
                {"where": f"{where} " if where else "", "position": position},
            )
        return value


# --------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel, RefusedStreamOptions):
    include_usage: bool = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # "schema" would shadow BaseModel.schema.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: {"type": "json_schema", "json_schema": {name,
    schema, strict}}, {"type": "json_object"} or {"type": "text"}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` body field (the openai client's extra_body)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None
    # The longest whitespace run in JSON output (0 = none); None = the server's default.
    max_whitespace: int | None = Field(None, ge=0, le=MAX_WHITESPACE)


TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class SamplingFields(OpenAIBaseModel, GuidedDecodingFields, RefusedVllmFields):
    """Fields shared by /v1/completions and /v1/chat/completions; the vLLM
    extras (`top_k`, `min_p`, ...) arrive through the client's `extra_body`."""

    # NOTE: every integer has bounds here (so the OpenAPI schema says them and
    # a 10**30 is a 400 naming the field); SamplingParams checks them again.
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = None
    # OpenAI's {"token id": bias}: JSON keys are strings; sampling_params() makes them ints.
    logit_bias: (
        dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None
    ) = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's per-request arguments of the server's logits processors (the
    # openai client's extra_body={"vllm_xargs": {...}}): SamplingParams.extra_args.
    vllm_xargs: dict[Annotated[str, Field(max_length=256)], XargValue] | None = Field(None, max_length=MAX_XARGS)
    # vLLM's token controls (ids are checked against the vocabulary by SamplingParams.validate_vocab).
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = (
        Field(None, max_length=MAX_BAD_WORDS)
    )
    # Their logprobs in place of the top-k (and they turn logprobs on).
    logprob_token_ids: list[TokenId] | None = Field(None, max_length=MAX_LOGPROB_TOKEN_IDS)
    # -1: as many as leave room for one generated token; must be below max_model_len.
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Legacy: the best of best_of samples. Not implemented (vLLM V1 neither):
    # omitted or equal to n, else a 400 rather than silently ignored. Left
    # out of the OpenAPI schema, which cannot say "equal to n": the schema
    # lists what is served, and best_of = n changes nothing.
    best_of: SkipJsonSchema[int | None] = Field(None, ge=1, le=MAX_N)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`response_format`, `structured_outputs` or the guided_* aliases as
        StructuredOutputsParams (InvalidRequestError naming the body field
        when malformed or when two of them are sent)."""
        response_format = self.response_format
        if response_format is not None and response_format.type == "text":
            response_format = None
        if response_format is not None and self.structured_outputs is not None:
            raise InvalidRequestError(
                "response_format", response_format.type, "cannot be combined with structured_outputs; send one"
            )
        other_source = "structured_outputs" if self.structured_outputs is not None else (
            "response_format" if response_format is not None else None)
        guided = self.guided_structured_outputs(other_source)
        if guided is not None:
            return StructuredOutputsParams(**guided)
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True)
            return StructuredOutputsParams(**fields)
        if response_format is None:
            return None
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format.json_schema.schema", None, "a JSON schema is required when type is 'json_schema'"
            )
        return StructuredOutputsParams(json=response_format.json_schema.schema_)

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        extra_stop_token_ids: list[int] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; a field it leaves unset takes the
        server's default (`defaults`: the generation config's, vLLM's
        default_sampling_params), else SamplingParams' own."""
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                "best_of", self.best_of, f"not supported; best_of must equal n ({self.n}) or be omitted"
            )
        stop_token_ids = list(self.stop_token_ids or [])
        for token_id in extra_stop_token_ids or []:
            if token_id not in stop_token_ids:
                stop_token_ids.append(token_id)
        # Unset: the server's default, else left out so SamplingParams' own applies.
        optional: dict[str, Any] = dict(defaults or {})
        optional.pop("max_tokens", None)  # the caller decides max_tokens (default_max_tokens)
        requested: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        optional.update((name, value) for name, value in requested.items() if value is not None)
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            # NOTE: as vLLM, explicit ids take the place of the top-k.
            logprobs=None if self.logprob_token_ids else logprobs,
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=self.logprob_token_ids or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            structured_outputs=self.structured_outputs_params(),
            logit_bias=self.logit_bias_by_token_id(),
            extra_args=dict(self.vllm_xargs) if self.vllm_xargs else None,
            **{name: value for name, value in optional.items() if value is not None},
        )

    def logit_bias_by_token_id(self) -> dict[int, float] | None:
        """`logit_bias` with int keys; a key that is not a decimal token id is a
        400 naming `logit_bias` (ids past the vocabulary: validate_vocab)."""
        if self.logit_bias is None:
            return None
        bias_by_id: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            # ASCII digits only: int() would also take " 7", "+7", "1_0" and other scripts' digits.
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(
                    "logit_bias", short_value(key), "keys must be token ids written as decimal integers ('50256')"
                )
            if len(key) > len(str(INT64_MAX)):
                raise InvalidRequestError("logit_bias", short_value(key), f"keys must be token ids <= {INT64_MAX}")
            bias_by_id[int(key)] = bias
        return bias_by_id

    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY


# Token-id lists longer than this are checked by the loops below, not by
# pydantic-core: its validation holds the GIL (about 0.3 us an item), so a
# 4 MB body of ids would stall the event loop for 0.2 s even from a worker
# thread, while a Python loop lets the interpreter switch threads every 5 ms.
LARGE_LIST_ITEMS = 4096


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _all_ints(values: list[Any]) -> bool:
    return all(type(value) is int for value in values)


def _large_token_id_prompt(value: Any) -> bool:
    """A large, well-formed list of ids, or of non-empty id lists (what the
    prompt's pydantic union accepts; ids are range-checked with the prompt)."""
    if not isinstance(value, list) or not value:
        return False
    if type(value[0]) is int:
        return len(value) > LARGE_LIST_ITEMS and _all_ints(value)
    return (
        sum(len(item) if isinstance(item, list) else 0 for item in value) > LARGE_LIST_ITEMS
        and all(isinstance(item, list) and item and _all_ints(item) for item in value)
    )


class CompletionRequest(SamplingFields, RefusedCompletionFields):
    # NOTE: non-empty at every level, so the OpenAPI schema admits only what is served.
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # vLLM extras
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _large_token_ids_in_python(cls, value: Any, handler: Any) -> Any:
        return value if _large_token_id_prompt(value) else handler(value)

    def num_top_logprobs(self) -> int | None:
        """Entries per position besides the chosen token (logprob_token_ids
        count), or None: no logprobs in the answer."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    def requested_max_tokens(self, defaults: Mapping[str, Any]) -> int | None:
        """max_tokens as sent; not sent: the server's default (the generation
        config's max_new_tokens), else 16; null: that default, else the
        context's rest (None)."""
        if "max_tokens" not in self.model_fields_set:
            return int(defaults.get("max_tokens", self.max_tokens or 16))
        return self.max_tokens if self.max_tokens is not None else _int_or_none(defaults.get("max_tokens"))


# ---- tools (function calling); the logic is in tool_calls.py

# OpenAI's limits: at most 128 tools, names of letters, digits, _ and -, up to 64.
MAX_TOOLS = 128
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# A tool call id we accept back in messages (ours are "call_" + 24 hex digits).
MAX_TOOL_CALL_ID_CHARS = 256


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    # A JSON schema of the arguments (an object); None = no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"]
    function: ChatCompletionNamedFunction


class FunctionCallParam(OpenAIBaseModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    arguments: str  # JSON text of an object, as the API returned it


class ToolCallParam(OpenAIBaseModel):
    """A call in an assistant message the client sends back."""

    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"]
    function: FunctionCallParam


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


# OpenAI's rules, stated in the schema (check_tool_messages enforces them):
# a tool message names the call it answers; only assistant messages carry calls.
TOOL_MESSAGE_RULES: JsonDict = {"allOf": [
    {"anyOf": [
        {"properties": {"role": {"enum": ["system", "developer", "user", "assistant"]}}},
        {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
    ]},
    {"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"tool_calls": {"type": "null"}}},
    ]},
]}


def empty_template_kwargs_as_none(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs: {}` asks for nothing: the same as leaving it out."""
    return value or None


class ChatMessage(OpenAIBaseModel, RefusedMessageFields):
    model_config = ConfigDict(json_schema_extra=TOOL_MESSAGE_RULES)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant message's calls; a tool message's answer names its call.
    tool_calls: list[ToolCallParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)

    _content_parts = field_validator("content", mode="before")(check_content_parts)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, RefusedChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    # The newer OpenAI name; wins over max_tokens when both are sent.
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extras
    add_generation_prompt: bool = True
    # The request's own template and extra template variables: refused (400)
    # unless the server trusts request templates (--trust-request-chat-template).
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    _empty_kwargs = field_validator("chat_template_kwargs")(empty_template_kwargs_as_none)
    # Function calling (entrypoints/openai/tool_calls.py). tool_choice omitted:
    # "auto" with tools, "none" without (OpenAI's defaults).
    tools: list[ChatCompletionToolsParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool = True

    def wants_logprobs(self) -> bool:
        """logprobs: true, or logprob_token_ids (which turn them on)."""
        return self.logprobs or bool(self.logprob_token_ids)

    def requested_max_tokens(self, defaults: Mapping[str, Any]) -> int | None:
        """max_completion_tokens, else max_tokens, else the server's default
        (the generation config's max_new_tokens), else None: the context's rest."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else _int_or_none(defaults.get("max_tokens"))


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    # Exactly one of prompt and messages (the route's schema says so too).
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages only; as in ChatCompletionRequest.
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    _empty_kwargs = field_validator("chat_template_kwargs")(empty_template_kwargs_as_none)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    # Checked against the vocabulary by the route; bounded here for the schema.
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]

    @field_validator("tokens", mode="wrap")
    @classmethod
    def _large_token_ids_in_python(cls, value: Any, handler: Any) -> Any:
        if (
            isinstance(value, list) and len(value) > LARGE_LIST_ITEMS and _all_ints(value)
            and min(value) >= 0 and max(value) <= INT64_MAX
        ):
            return value
        return handler(value)


# -------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo = Field(default_factory=PromptTokenUsageInfo)


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: four parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ChatCompletionTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogprob(ChatCompletionTopLogprob):
    top_logprobs: list[ChatCompletionTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: the first has id, type and name; later
    ones append to arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # OpenAI sends the key only with calls.
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)
    # The reasoning section (--reasoning-parser); vLLM's field, kept by the
    # openai client in `model_extra`.
    reasoning_content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # A LoRA adapter's content digest (its KV identity): what a router hashes
    # an adapter request's prompt blocks with. None for the base model.
    lora_digest: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class KVEventsResponse(BaseModel):
    """GET /v1/kv_events: what the server's prefix caches hold, for a router."""

    # The number of the latest change; ask with after=seq next time.
    seq: int
    block_size: int
    hash_algo: str
    # True: `block_hashes` lists every hash held; False: `events` lists the changes after `after`.
    snapshot: bool
    block_hashes: list[str] | None = None  # hex
    events: list[tuple[Literal["stored", "removed"], str]] | None = None  # (change, hex hash)


class ServerInfoResponse(BaseModel):
    version: str
    model: str
    max_model_len: int
    api_pid: int
    # None when the engine core runs in the server's process.
    engine_pid: int | None
    # Every data-parallel replica's engine core, by replica index ([engine_pid] for one).
    engine_pids: list[int | None] = []
    # What a request's unset sampling fields default to: the generation
    # config's values (model.generation_config, model.override_generation_config).
    default_sampling_params: dict[str, float | int] = {}


class RankMemoryUsage(BaseModel):
    # The process holding the rank (the engine core's with the uni executor).
    pid: int
    weights_bytes: int
    kv_cache_bytes: int
    # Of a KV cache in host memory, the pages written so far (they grow the
    # RSS as blocks are first used); 0 on a device, -1 where unknown.
    kv_cache_resident_bytes: int


class MemoryUsageResponse(BaseModel):
    # By rank (the first data-parallel replica's).
    ranks: list[RankMemoryUsage]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
    )

