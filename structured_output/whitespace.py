"""How much free whitespace a request's JSON grammar allows, and how a backend
is told (see GrammarBackend's class docstring).

The request's `structured_outputs.max_whitespace` wins over the engine's
`structured_output.max_whitespace`; `disable_any_whitespace` (either) wins
over both; 0 is exactly `disable_any_whitespace`, so both give one grammar.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from pagedllm.core.config import StructuredOutputConfig
    from pagedllm.core.sampling_params import StructuredOutputsParams


class WhitespaceOptions(NamedTuple):
    # False: no free whitespace in JSON (the backend's compact separators).
    any_whitespace: bool
    # The longest run between two tokens (>= 1) when any_whitespace; None = unbounded.
    max_whitespace: int | None


def resolve_whitespace(params: StructuredOutputsParams, config: StructuredOutputConfig) -> WhitespaceOptions:
    if params.disable_any_whitespace or config.disable_any_whitespace:
        return WhitespaceOptions(False, None)
    limit = params.max_whitespace if params.max_whitespace is not None else config.max_whitespace
    if limit == 0:
        # NOTE: xgrammar refuses max_whitespace_cnt=0; "none" is any_whitespace=False.
        return WhitespaceOptions(False, None)
    return WhitespaceOptions(True, limit)


def backend_kwargs(method: Callable[..., Any], options: WhitespaceOptions) -> dict[str, Any]:
    """The keywords to call a backend's `validate` / `compile` with.

    NOTE: `max_whitespace` is passed only to a method whose signature names
    it (plugin API 1.1); a 1.0 backend, or a subclass that overrides
    `compile` with the 1.0 signature, is called exactly as before.
    """
    kwargs: dict[str, Any] = {"any_whitespace": options.any_whitespace}
    if _takes_max_whitespace(getattr(method, "__func__", method)):
        kwargs["max_whitespace"] = options.max_whitespace
    return kwargs


@cache
def _takes_max_whitespace(function: Callable[..., Any]) -> bool:
    try:
        return "max_whitespace" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature
        return False
