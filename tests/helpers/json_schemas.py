"""JSON schemas for the structured-output tests and benchmark.

NOTE: every string, array and number is bounded (maxLength, maxItems,
minimum/maximum, bounded patterns), so each schema's language is finite: a
random-weight model constrained by the grammar must close every value, and
with `disable_any_whitespace` the longest sentence of every schema here is
under 200 characters, so `max_tokens=MAX_TOKENS` (each token >= 1 character,
plus EOS) always leaves room to finish. Termination is certain, not lucky.
"""

from __future__ import annotations

from typing import Any

MAX_TOKENS = 256

_int = lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}  # noqa: E731
_str = lambda hi, lo=0: {"type": "string", "minLength": lo, "maxLength": hi}  # noqa: E731


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None
            else required, "additionalProperties": False, **extra}


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_object": _obj({"name": _str(8), "age": _int(0, 120)}),
    "nested_object": _obj({"user": _obj({"id": _int(1, 9999), "profile": _obj({
        "nick": _str(6, 1), "active": {"type": "boolean"}})})}),
    "int_array_bounds": _obj({"values": {"type": "array", "items": _int(-50, 50), "minItems": 1, "maxItems": 4}}),
    "string_array_bounds": _obj({"tags": {"type": "array", "items": _str(5), "minItems": 2, "maxItems": 3}}),
    "enum_string": _obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    "const_values": _obj({"version": {"const": "1.0"}, "kind": {"const": 3}}),
    "pattern_code": _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "any_of": _obj({"value": {"anyOf": [_int(0, 9), _str(4)]}}),
    "one_of_tagged": _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "r": _int(1, 10)}),
        _obj({"kind": {"const": "square"}, "side": _int(1, 10)}),
    ]}}),
    "ref_defs": {**_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
                 "$defs": {"point": _obj({"x": _int(-10, 10), "y": _int(-10, 10)})}},
    "optional_props_no_extra": _obj({"a": _int(0, 5), "b": {"type": "boolean"}}, required=["a"]),
    "number_bounds": _obj({"temperature": {"type": "number", "minimum": -20, "maximum": 50}}),
    "exclusive_bounds": _obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "string_length_bounds": _obj({"word": _str(5, 3)}),
    "bool_and_null": _obj({"flag": {"type": "boolean"}, "nothing": {"type": "null"}}),
    "array_of_objects": _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": _obj({"id": _int(0, 99), "label": _str(4)})}}),
    "nested_arrays": _obj({"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": _int(0, 9)}}}),
    "mixed_enum": _obj({"level": {"enum": [1, 2, "high", None]}}),
    "top_level_array": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 5},
    "top_level_enum": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    "date_pattern": _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "ref_enum": {**_obj({"status": {"$ref": "#/$defs/status"}, "count": _int(0, 3)}),
                 "$defs": {"status": {"type": "string", "enum": ["open", "closed"]}}},
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _int(0, 3)})})})}),
    "nullable_any_of": _obj({"nickname": {"anyOf": [_str(5), {"type": "null"}]}}),
    "number_array": _obj({"prices": {"type": "array", "maxItems": 3,
                                     "items": {"type": "number", "minimum": 0, "maximum": 100}}}),
    "email_pattern": _obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    "all_of": {"allOf": [_obj({"id": _int(0, 9)})]},
}
