"""Request bodies parsed and validated off the event loop.

FastAPI parses a body model's JSON and validates it on the event loop: about
1 ms per MB for a string prompt, but 50-80 ms per MB for a prompt of token
ids (a 4 MB body stalled /health for ~0.4 s). The POST routes therefore take
the raw request and call `parse_body`, which does both in the request worker
pool once a body is large enough to matter; errors are the same
RequestValidationError FastAPI raises (a 400 naming the field).

Every such body must be sent as `Content-Type: application/json` (a charset
parameter, if any, utf-8), else 415 before it is read: a web page can make a
browser send text/plain, form or multipart bodies to any origin without a
CORS preflight, so a server on the operator's machine would otherwise obey
any page the operator opens. A missing Content-Type is refused too (no
client library omits it for JSON; the openai client and httpx `json=` send it).

The routes document their body with `body_openapi(Model)`; `openapi_models`
lists the models whose schemas the OpenAPI document must then carry.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIServingError, echo

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastapi import Request

    from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool

M = TypeVar("M", bound=BaseModel)

# Smaller bodies parse inline: faster than a hop to the pool and far below
# anything that could stall the loop.
INLINE_BODY_BYTES = 64 << 10


async def parse_body(raw_request: Request, model: type[M], pool: RequestWorkerPool) -> M:
    problem = json_content_type_problem(raw_request.headers.getlist("content-type"))
    if problem is not None:
        raise OpenAIServingError(415, problem, "content-type")
    body = await raw_request.body()
    if len(body) < INLINE_BODY_BYTES:
        return validate_body(model, body)
    return await pool.run(validate_body, model, body, True)


def json_content_type_problem(content_types: Sequence[str]) -> str | None:
    """Why a body sent with these Content-Type header values is not taken as
    JSON (the 415's message), or None when it is `application/json`."""
    if len(content_types) != 1:
        given = "none" if not content_types else f"{len(content_types)} Content-Type headers"
        return f"content-type: the body must be sent as 'Content-Type: application/json' (got {given})"
    media_type, *parameters = (part.strip().lower() for part in content_types[0].split(";"))
    charsets = {value.strip('"') for name, _, value in (p.partition("=") for p in parameters) if name == "charset"}
    if media_type != "application/json" or not charsets <= {"utf-8", "utf8"}:
        return (f"content-type: the body must be sent as 'Content-Type: application/json' (charset utf-8 if "
                f"any), not {echo(content_types[0])!r}")
    return None


def _int_yielding_the_gil(text: str) -> int:
    return int(text)


def validate_body(model: type[M], body: bytes, in_worker: bool = False) -> M:
    """`model` from a JSON body; RequestValidationError when it is not JSON
    (invalid UTF-8, nested too deep for the parser) or does not validate.

    `in_worker`: json's C parser holds the GIL for the whole body (60 ms for
    4 MB of token ids, longer on a busy machine); a Python `parse_int` makes
    every number a point where the event loop's thread can take the GIL back
    (worst gap measured: 56 ms -> 11 ms, for 1.6x the parse time)."""
    try:
        data = json.loads(body, parse_int=_int_yielding_the_gil) if in_worker else json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "ctx": {"error": detail}}]
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def body_openapi(model: type[BaseModel], extra_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `openapi_extra` of a route whose body is `model` (plus `extra_schema`
    keywords, e.g. a oneOf the model cannot state)."""
    schema: dict[str, Any] = {"$ref": f"#/components/schemas/{model.__name__}"}
    if extra_schema:
        schema = {"allOf": [schema], **extra_schema}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_model_schemas(components: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Put `models` (and the models they use) into the OpenAPI components."""
    schemas = components.setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas[model.__name__] = schema
