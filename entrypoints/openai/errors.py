"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports (validation, auth, limits, a dead engine)
goes through `error_body`, so clients (the `openai` package, lm-eval) always
see the same shape with the HTTP status repeated in `code`.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from http import HTTPStatus
from typing import Any

from pagedllm.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# A client's value quoted in an error keeps at most this many characters
# (a 3.9 MB model name was echoed whole in a 404).
MAX_ECHO_CHARS = 100
# No error message is longer than this: beyond it the middle is cut (its
# start names the field, its end the limit).
MAX_MESSAGE_CHARS = 2000

# HTTP status -> OpenAI error type, as the openai client names its exceptions.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIServingError(Exception):
    """An error a route raises on purpose; the app turns it into its response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    message = printable(_bounded(message))
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def echo(value: str) -> str:
    """A client's string as an error quotes it: its first MAX_ECHO_CHARS
    characters, then how long it really was."""
    if len(value) <= MAX_ECHO_CHARS:
        return value
    return f"{value[:MAX_ECHO_CHARS]}... ({len(value)} characters)"


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    half = MAX_MESSAGE_CHARS // 2
    return f"{message[:half]} ... {message[-half:]}"


def invalid_request_message(exc: InvalidRequestError) -> str:
    """The text of an InvalidRequestError with the client's value shortened."""
    return f"{exc.field}={_short(exc.value)} is invalid: {exc.limit}"


def printable(text: str) -> str:
    """`text` with lone UTF-16 surrogates escaped (`\\ud800`): an error that
    quotes a client's bad string must still encode as UTF-8 JSON."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()


def internal_error_message(exc: BaseException, where: str) -> str:
    """Log an unexpected exception under a fresh id and return the message a
    client gets: that it failed and the id, never the exception's text
    (it may hold paths, code or other clients' data)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("unhandled error %s %s", error_id, where, exc_info=exc)
    return f"internal server error (error id {error_id}; the server log has the details)"


def invalid_request(exc: InvalidRequestError) -> OpenAIServingError:
    return OpenAIServingError(400, invalid_request_message(exc), exc.field)


# Union-typed fields: pydantic reports one error per union member; say it once.
_UNION_MESSAGES = {
    "prompt": "must be a non-empty string, or a non-empty list of non-empty strings, of token ids or of "
              "non-empty token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts ({'type': 'text', 'text': ...})",
    "tokens": "must be a list of token ids",
}


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member in `loc` ('str', 'list[int]', 'ChatMessage').
    return isinstance(part, str) and (
        "[" in part or part in {"str", "int", "float", "bool", "list", "dict", "none"} or part[:1].isupper()
        or part.startswith("constrained-")
    )


def describe_validation_error(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) for a FastAPI/pydantic validation error list."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    error_type = first.get("type", "")
    if error_type in ("json_invalid", "json_type") or not loc:
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return f"the request body is not a valid JSON object ({detail})", "body"
    path: list[str] = []
    for part in loc:
        if _is_union_tag(part):
            break
        path.append(str(part))
    param = ".".join(path)
    leaf = path[-1] if path else ""
    union_message = _UNION_MESSAGES.get(leaf)
    if union_message is not None and len(errors) > 1:
        return f"{param}: {union_message}", param
    value = first.get("input")
    message = first.get("msg", "invalid value")
    if error_type == "missing":
        return f"{param}: this field is required", param
    if error_type == "extra_forbidden":
        return f"{param}: unknown field", param
    if error_type in ("too_short", "string_too_short") and first.get("ctx", {}).get("min_length") == 1:
        return f"{param}: at least one {'character' if error_type == 'string_too_short' else 'item'} is required", param
    bound = _BOUNDS.get(error_type)
    if bound is not None and bound[0] in first.get("ctx", {}):
        # "seed=10**30: must be <= 9223372036854775807" rather than pydantic's sentence.
        message = f"must be {bound[1]} {first['ctx'][bound[0]]}"
        if isinstance(value, float) and math.isnan(value):  # Python's JSON parser reads NaN
            message = f"must be a number {bound[1]} {first['ctx'][bound[0]]}, not NaN"
    return f"{param}={_short(value)}: {message}", param


# pydantic's range errors: error type -> (its ctx key, the comparison it demands).
_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) > MAX_ECHO_CHARS:
        value = value[:MAX_ECHO_CHARS]  # repr() of a 4 MB string would copy it whole
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS - 3] + "..."
