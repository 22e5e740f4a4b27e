"""Size and nesting limits of a structured-output spec, checked before any
parser, recursive walker or compiler sees it: on the API side (before the
validator child) and in the engine core (before a compile), since a request
may also come from the offline `LLM` or a crafted engine message.

NOTE: everything here is iterative. A schema nested 10,000 deep must be
refused in microseconds, not end in RecursionError inside `json.loads`,
`json.dumps`, `copy.deepcopy` or a schema walker.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.core.sampling_params import StructuredOutputsParams

# Characters of a spec echoed in an error.
SUMMARY_CHARS = 80
# Deepest nesting the iterative walk follows: past it a dict is cyclic or absurd.
_WALK_DEPTH_CAP = 100_000
# A JSON string literal (escapes included); brackets inside it are not nesting.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def check_spec_limits(params: StructuredOutputsParams, config: StructuredOutputConfig) -> None:
    """InvalidRequestError (field `structured_outputs.<kind>`, a short form of
    the spec, the config key and its value) if the spec is past a limit."""
    kind = params.kind_name
    value = getattr(params, kind)
    field = f"structured_outputs.{kind}"
    if kind == "choice":
        _check_choices(field, list(value), config)
    elif kind in ("json", "structural_tag") and not isinstance(value, bool):
        _check_json_spec(field, value, config)
    elif kind in ("regex", "grammar"):
        _check_size(field, value, _utf8_len(field, value), config)


def json_text_depth(text: str) -> int:
    """Nesting depth of JSON text ({} and [] levels; 0 for a scalar), without parsing it."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def json_value_depth(value: Any, max_nodes: int) -> int:
    """Nesting depth of a dict/list value (0 for a scalar), iteratively.
    Raises _TooManyNodes past `max_nodes` values (containers included)."""
    if not isinstance(value, (dict, list, tuple)):
        return 0
    deepest, num_nodes = 0, 1
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        num_nodes += len(children)
        if num_nodes > max_nodes:
            raise _TooManyNodes
        if depth <= _WALK_DEPTH_CAP:  # NOTE: a cyclic dict stops here
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def summary(value: Any, depth_ok: bool = True) -> str:
    """A short form of a spec for error messages (never recursive past the limit)."""
    if isinstance(value, str):
        text = value
    elif depth_ok:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    else:
        return f"<{type(value).__name__} nested too deep to show>"
    if len(text) <= SUMMARY_CHARS:
        return text
    return f"{text[: SUMMARY_CHARS - 3]}... ({len(text.encode('utf-8', 'surrogatepass'))} bytes)"


class _TooManyNodes(Exception):
    pass


def _check_json_spec(field: str, value: Any, config: StructuredOutputConfig) -> None:
    max_depth = config.max_schema_depth
    if isinstance(value, str):
        if len(value) > 4 * config.max_spec_bytes:  # far too big: not worth a depth scan
            _check_size(field, value, _utf8_len(field, value), config)
        depth = json_text_depth(value)  # before the size: the better message for deep specs
    else:
        # n JSON values take at least 2n - 1 bytes: a walk past max_spec_bytes
        # values is over the size limit anyway (and a dict sharing subtrees
        # cannot blow the walk up).
        try:
            depth = json_value_depth(value, config.max_spec_bytes)
        except _TooManyNodes:
            raise InvalidRequestError(
                field, f"<{type(value).__name__} of over {config.max_spec_bytes} values>",
                f"over {config.max_spec_bytes} JSON values cannot fit "
                f"structured_output.max_spec_bytes = {config.max_spec_bytes}",
            ) from None
    if depth > max_depth:
        raise InvalidRequestError(
            field, summary(value, depth_ok=isinstance(value, str)),
            f"nesting depth {depth} exceeds structured_output.max_schema_depth = {max_depth}",
        )
    if isinstance(value, str):
        _check_size(field, value, _utf8_len(field, value), config)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(field, summary(value), f"not JSON-serializable: {exc}") from None
        _check_size(field, text, _utf8_len(field, text), config)


def _check_choices(field: str, choices: list[str], config: StructuredOutputConfig) -> None:
    if len(choices) > config.max_choices:
        raise InvalidRequestError(
            field, f"<{len(choices)} choices>",
            f"{len(choices)} choices exceed structured_output.max_choices = {config.max_choices}",
        )
    num_bytes = sum(_utf8_len(field, choice) for choice in choices)
    if num_bytes > config.max_spec_bytes:
        raise InvalidRequestError(
            field, f"<{len(choices)} choices of {num_bytes} bytes>",
            f"size {num_bytes} bytes exceeds structured_output.max_spec_bytes = {config.max_spec_bytes}",
        )


def _check_size(field: str, text: str, num_bytes: int, config: StructuredOutputConfig) -> None:
    if num_bytes > config.max_spec_bytes:
        raise InvalidRequestError(
            field, summary(text),
            f"size {num_bytes} bytes exceeds structured_output.max_spec_bytes = {config.max_spec_bytes}",
        )


def _utf8_len(field: str, text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        # No encoder after this (msgspec, the compiler) could take it either.
        raise InvalidRequestError(
            field, summary(text[max(exc.start - 20, 0): exc.end + 20].encode("utf-8", "backslashreplace").decode()),
            f"an unpaired UTF-16 surrogate at character {exc.start} is not text",
        ) from None
