"""OpenAI and vLLM request fields pagedllm does not implement yet, and the
ones it accepts and ignores on purpose. All lists are explicit.

A client that sends `audio` and gets plain text back cannot tell it
was never seen, so every field of UNSUPPORTED_CHAT_FIELDS with a value is a
400 naming it (until it is implemented). The fields of vLLM's protocol that
would change the answer (VLLM_REFUSED_*) are a 400 too, unless they carry
the value that changes nothing (`use_beam_search: false`, `length_penalty: 1`).
vLLM's older guided_* fields are aliases of structured_outputs
(guided_decoding.py), all but guided_whitespace_pattern.
Fields some client libraries add on their own (IGNORED_FIELDS) change
nothing about the answer and are accepted; any other unknown field is
ignored too (`extra="ignore"`), as OpenAI does.

The refused fields are left out of the OpenAPI schema (`SkipJsonSchema`):
the schema describes what the server accepts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

# Chat-completion body fields with no implementation yet.
UNSUPPORTED_CHAT_FIELDS = (
    "functions", "function_call", "audio", "modalities", "prediction", "web_search_options", "reasoning_effort",
)
# Message fields of the deprecated function calling (use tool_calls) and audio output.
UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio")
# Accepted and ignored: bookkeeping for OpenAI's own platform, no effect on the
# output (vLLM's return_token_offsets, mm_payload and return_mm_kwargs only act
# on its /render routes; its session_id is a routing identity).
IGNORED_FIELDS = (
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "return_token_offsets",
    "mm_payload", "return_mm_kwargs", "session_id",
)
# vLLM's fields of both routes that pagedllm does not implement, with the
# values that change nothing (None is always one).
VLLM_REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "request_id": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    # vLLM 0.32's
    "watermarking": (False,),
    "return_prompt_text": (False,),
    "stream_interval": (1,),
    "routed_experts_prompt_start": (0,),
}
# vLLM's chat-only fields pagedllm does not implement.
VLLM_REFUSED_CHAT_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "documents": (),
    "include_reasoning": (True,),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
    "prompt_logprobs": (),
}
# Completion-only fields: OpenAI's suffix (insert mode) and vLLM's prompt_embeds.
VLLM_REFUSED_COMPLETION_FIELDS: dict[str, tuple[Any, ...]] = {"suffix": (), "prompt_embeds": ()}
# What to send instead, where the server has it.
REFUSAL_HINTS = {
    "guided_whitespace_pattern": "use structured_outputs.max_whitespace or disable_any_whitespace",
    "structural_tag": "use structured_outputs.structural_tag",
    "logits_processors": "the server's logits processors take per-request arguments in vllm_xargs",
    "prompt_logprobs": "it is served on /v1/completions",
}
# Content-part types of OpenAI's chat messages that pagedllm cannot read (it serves text models).
UNSUPPORTED_CONTENT_PARTS = ("image_url", "input_audio", "file", "refusal")


def refuse(value: Any, field: str, no_op_values: tuple[Any, ...] = ()) -> Any:
    if value is not None and not any(_same(value, no_op) for no_op in no_op_values):
        hint = REFUSAL_HINTS.get(field, "remove the field")
        raise PydanticCustomError(
            "unsupported_field", "{field} is not supported by this server yet; {hint}", {"field": field, "hint": hint},
        )
    return value


def _same(value: Any, no_op: Any) -> bool:
    """JSON equality: 1 is 1.0, but false is not 0."""
    if isinstance(value, bool) or isinstance(no_op, bool):
        return value is no_op
    if isinstance(no_op, float):
        return isinstance(value, (int, float)) and value == no_op
    return type(value) is type(no_op) and value == no_op


class RefusedVllmFields(BaseModel):
    use_beam_search: SkipJsonSchema[Any] = None
    length_penalty: SkipJsonSchema[Any] = None
    logits_processors: SkipJsonSchema[Any] = None
    return_tokens_as_token_ids: SkipJsonSchema[Any] = None
    return_token_ids: SkipJsonSchema[Any] = None
    request_id: SkipJsonSchema[Any] = None
    kv_transfer_params: SkipJsonSchema[Any] = None
    ec_transfer_params: SkipJsonSchema[Any] = None
    repetition_detection: SkipJsonSchema[Any] = None
    thinking_token_budget: SkipJsonSchema[Any] = None
    guided_whitespace_pattern: SkipJsonSchema[Any] = None
    structural_tag: SkipJsonSchema[Any] = None
    watermarking: SkipJsonSchema[Any] = None
    return_prompt_text: SkipJsonSchema[Any] = None
    stream_interval: SkipJsonSchema[Any] = None
    routed_experts_prompt_start: SkipJsonSchema[Any] = None

    @field_validator(*VLLM_REFUSED_FIELDS, mode="before")
    @classmethod
    def _refuse_vllm(cls, value: Any, info: Any) -> Any:
        return refuse(value, info.field_name, VLLM_REFUSED_FIELDS[info.field_name])


class RefusedVllmChatFields(BaseModel):
    echo: SkipJsonSchema[Any] = None
    continue_final_message: SkipJsonSchema[Any] = None
    add_special_tokens: SkipJsonSchema[Any] = None
    documents: SkipJsonSchema[Any] = None
    include_reasoning: SkipJsonSchema[Any] = None
    mm_processor_kwargs: SkipJsonSchema[Any] = None
    media_io_kwargs: SkipJsonSchema[Any] = None
    prompt_logprobs: SkipJsonSchema[Any] = None

    @field_validator(*VLLM_REFUSED_CHAT_FIELDS, mode="before")
    @classmethod
    def _refuse_vllm_chat(cls, value: Any, info: Any) -> Any:
        return refuse(value, info.field_name, VLLM_REFUSED_CHAT_FIELDS[info.field_name])


class RefusedCompletionFields(BaseModel):
    suffix: SkipJsonSchema[Any] = None
    prompt_embeds: SkipJsonSchema[Any] = None

    @field_validator(*VLLM_REFUSED_COMPLETION_FIELDS, mode="before")
    @classmethod
    def _refuse_completion(cls, value: Any, info: Any) -> Any:
        return refuse(value, info.field_name, VLLM_REFUSED_COMPLETION_FIELDS[info.field_name])


class RefusedStreamOptions(BaseModel):
    # vLLM's usage in every chunk.
    continuous_usage_stats: SkipJsonSchema[Any] = None

    @field_validator("continuous_usage_stats", mode="before")
    @classmethod
    def _refuse_stream_option(cls, value: Any, info: Any) -> Any:
        return refuse(value, "stream_options.continuous_usage_stats", (False,))


class RefusedChatFields(RefusedVllmChatFields):
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None
    modalities: SkipJsonSchema[Any] = None
    prediction: SkipJsonSchema[Any] = None
    web_search_options: SkipJsonSchema[Any] = None
    reasoning_effort: SkipJsonSchema[Any] = None

    @field_validator(*UNSUPPORTED_CHAT_FIELDS, mode="before")
    @classmethod
    def _refuse(cls, value: Any, info: Any) -> Any:
        return refuse(value, info.field_name)


class RefusedMessageFields(BaseModel):
    function_call: SkipJsonSchema[Any] = None
    audio: SkipJsonSchema[Any] = None

    @field_validator(*UNSUPPORTED_MESSAGE_FIELDS, mode="before")
    @classmethod
    def _refuse(cls, value: Any, info: Any) -> Any:
        return refuse(value, info.field_name)


def check_content_parts(value: Any) -> Any:
    """A message's content parts: a non-text part is a 400 saying so (not
    pydantic's list of every union member it failed to match)."""
    if isinstance(value, list):
        for part in value:
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type in UNSUPPORTED_CONTENT_PARTS:
                raise PydanticCustomError(
                    "unsupported_content_part",
                    "content parts of type '{part_type}' are not supported (this server reads text only)",
                    {"part_type": part_type},
                )
    return value
