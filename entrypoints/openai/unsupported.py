"""OpenAI request fields pagedllm does not implement yet, and the ones it
accepts and ignores on purpose. Both lists are explicit.

A client that sends `audio` and gets plain text back cannot tell it
was never seen, so every field of UNSUPPORTED_CHAT_FIELDS with a value is a
400 naming it (until it is implemented). Fields some client libraries add on
their own (IGNORED_FIELDS) change nothing about the answer and are accepted;
any other unknown field is ignored too (`extra="ignore"`), as OpenAI does.

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
# Accepted and ignored: bookkeeping for OpenAI's own platform, no effect on the output.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
# Content-part types of OpenAI's chat messages that pagedllm cannot read (it serves text models).
UNSUPPORTED_CONTENT_PARTS = ("image_url", "input_audio", "file", "refusal")


def refuse(value: Any, field: str) -> Any:
    if value is not None:
        raise PydanticCustomError(
            "unsupported_field", "{field} is not supported by this server yet; remove the field",
            {"field": field},
        )
    return value


class RefusedChatFields(BaseModel):
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
