"""vLLM's older structured-output fields (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `guided_decoding_backend`): aliases of
the `structured_outputs` fields, on both routes.

One request names one constraint: an alias beside `structured_outputs` (or
`response_format`), or two different guided constraints, is a 400 naming
both fields. `guided_whitespace_pattern` has no `structured_outputs`
counterpart and stays refused (unsupported.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from pagedllm.core.errors import InvalidRequestError

# Alias -> the structured_outputs field it stands for.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_decoding_backend": "backend",
}
# The aliases that are constraints (the backend only picks who enforces one).
GUIDED_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class GuidedDecodingFields(BaseModel):
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM's alias of structured_outputs.json: a JSON schema the output follows"
    )
    guided_regex: str | None = Field(None, description="vLLM's alias of structured_outputs.regex")
    guided_choice: list[str] | None = Field(
        None, description="vLLM's alias of structured_outputs.choice: the output is one of these strings"
    )
    guided_grammar: str | None = Field(
        None, description="vLLM's alias of structured_outputs.grammar (EBNF, root rule `root`)"
    )
    guided_decoding_backend: str | None = Field(
        None, description="vLLM's alias of structured_outputs.backend: a registered grammar backend"
    )

    def guided_fields_given(self) -> list[str]:
        return [name for name in GUIDED_FIELDS if getattr(self, name) is not None]

    def guided_structured_outputs(self, other_source: str | None) -> dict[str, Any] | None:
        """The structured_outputs fields the guided_* aliases stand for (None
        when none is given). `other_source`: the body field that already asks
        for structured output (structured_outputs, response_format), if any."""
        given = self.guided_fields_given()
        if not given:
            return None
        if other_source is not None:
            raise InvalidRequestError(
                given[0], _shown(getattr(self, given[0])), f"cannot be combined with {other_source}; send one"
            )
        constraints = [name for name in given if name in GUIDED_CONSTRAINTS]
        if len(constraints) > 1:
            raise InvalidRequestError(
                constraints[1], _shown(getattr(self, constraints[1])),
                f"cannot be combined with {constraints[0]}: one request has one constraint",
            )
        if not constraints:
            raise InvalidRequestError(
                "guided_decoding_backend", self.guided_decoding_backend,
                "needs a constraint to enforce: " + ", ".join(GUIDED_CONSTRAINTS),
            )
        return {GUIDED_FIELDS[name]: getattr(self, name) for name in given}


def guided_alias_of(internal_field: str, request: Any) -> str | None:
    """The guided_* field the client sent for `structured_outputs.<key>`, if
    the request used the alias."""
    if not isinstance(request, GuidedDecodingFields):
        return None
    for alias, key in GUIDED_FIELDS.items():
        if internal_field == f"structured_outputs.{key}" and getattr(request, alias) is not None:
            return alias
    return None


def _shown(value: Any) -> Any:
    return f"<{len(value)} items>" if isinstance(value, (dict, list)) else value
