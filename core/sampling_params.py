"""SamplingParams: vLLM's fields and defaults, validated with actionable errors."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pagedllm.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedllm.structured_output.interface import StructuredOutputKind

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for, per position.
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


# The spec fields of StructuredOutputsParams: exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of `json` (a JSON schema,
    dict or JSON text), `json_object` (True: any JSON object), `regex`,
    `choice` (list of strings), `grammar` (EBNF, root rule `root`) or
    `structural_tag` (xgrammar's structural-tag JSON, dict or text).

    `disable_any_whitespace`: JSON without free whitespace between tokens.
    `backend`: a registered grammar backend for this request (default: the
    engine's `structured_output.backend`).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        self._verify()

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """None, a StructuredOutputsParams, or its fields as a dict (the wire form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise InvalidRequestError(
                    "structured_outputs", unknown, "unknown fields; allowed: " + ", ".join(sorted(known))
                )
            return cls(**value)
        raise InvalidRequestError(
            "structured_outputs", _short_repr(value), "must be a StructuredOutputsParams, a dict or None"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def kind_name(self) -> str:
        return next(name for name in STRUCTURED_OUTPUT_KINDS if self._is_set(name))

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    def _verify(self) -> None:
        given = [name for name in STRUCTURED_OUTPUT_KINDS if self._is_set(name)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs", given or None,
                "exactly one of " + ", ".join(STRUCTURED_OUTPUT_KINDS) + " must be set",
            )
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidRequestError(f"structured_outputs.{name}", _short_repr(value),
                                              f"not valid JSON: {exc}") from None
            allowed = (dict, bool) if name == "json" else (dict,)
            if not isinstance(value, allowed):
                raise InvalidRequestError(f"structured_outputs.{name}", _short_repr(value),
                                          "must be a JSON object (dict or JSON text)")
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise InvalidRequestError("structured_outputs.json_object", self.json_object, "must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"structured_outputs.{name}", _short_repr(value),
                                          "must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError("structured_outputs.choice", _short_repr(self.choice),
                                      "must be a non-empty list of strings")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace", self.disable_any_whitespace,
                                      "must be true or false")
        if self.backend is not None and not (isinstance(self.backend, str) and self.backend):
            raise InvalidRequestError("structured_outputs.backend", self.backend,
                                      "must be a registered grammar backend name or None")

    def grammar_spec(self) -> tuple[StructuredOutputKind, str]:
        """(kind, spec text): the same spec gives the same text (the cache key)."""
        from pagedllm.structured_output.interface import StructuredOutputKind

        kind = StructuredOutputKind(self.kind_name)
        if kind in (StructuredOutputKind.JSON, StructuredOutputKind.STRUCTURAL_TAG):
            value = getattr(self, kind.value)
            if isinstance(value, str):
                value = json.loads(value)
            # NOTE: no sort_keys: property order is the order the output follows.
            return kind, json.dumps(value, ensure_ascii=False)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return kind, ""
        if kind is StructuredOutputKind.CHOICE:
            return kind, json.dumps(list(self.choice or ()), ensure_ascii=False)
        return kind, str(getattr(self, kind.value))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 (or -1) disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # None = up to max_model_len (see `validate_against`).
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Normalized to list[str] / list[int] in __post_init__.
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Constrain the output to a JSON schema, regex, choice list or grammar;
    # a dict (as it crosses the wire) is turned into StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._verify()
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        if self.temperature < SAMPLING_EPS:
            # Greedy ignores the truncation knobs; reset them like vLLM so the
            # sampler never has to special-case a "greedy with top_k" row.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        if not (_is_int(self.n) and self.n >= 1):
            raise InvalidRequestError("n", self.n, "must be an integer >= 1")
        _check_number("temperature", self.temperature, lambda v: v >= 0.0, "must be >= 0")
        _check_number("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            raise InvalidRequestError("top_k", self.top_k, "must be -1 or 0 (disabled) or a positive integer")
        _check_number("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: v > 0.0, "must be > 0")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError("seed", self.seed, "must be an integer or None")
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise InvalidRequestError("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise InvalidRequestError("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", self.min_tokens,
                                      f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(name, value, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidRequestError("extra_args", self.extra_args, "must be a dict or None")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """`stop_token_ids` as a set; EOS is the scheduler's business (ignore_eos)."""
        return set(self.stop_token_ids or ())

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params of sample `index` of an `n > 1` request: n=1 and, when seeded,
        seed + index (as vLLM), so siblings differ but stay reproducible."""
        child = self.clone()
        child.n = 1
        if child.seed is not None:
            child.seed += index
        return child

    def validate_against(self, max_model_len: int, num_prompt_tokens: int) -> int:
        """Check the request fits the context; returns the effective max_tokens."""
        left = max_model_len - num_prompt_tokens
        if left < 1:
            raise InvalidRequestError(
                "prompt", num_prompt_tokens,
                f"the prompt ({num_prompt_tokens} tokens) leaves no room to generate within "
                f"max_model_len ({max_model_len})",
            )
        if self.max_tokens is None:
            return left
        if self.max_tokens > left:
            raise InvalidRequestError(
                "max_tokens", self.max_tokens,
                f"exceeds the context left for this prompt ({max_model_len} - {num_prompt_tokens} = {left})",
            )
        return self.max_tokens


def _short_repr(value: Any, limit: int = 200) -> Any:
    text = value if isinstance(value, str) else repr(value)
    return value if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: Any, ok: Callable[[float], bool], limit: str) -> None:
    # NaN and inf fail every range check; bool is not a number here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, value, limit)
    if not ok(value):
        raise InvalidRequestError(name, value, limit)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise InvalidRequestError("stop", stop, "must be a string, a list of strings or None")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InvalidRequestError("stop", stop, "every stop string must be a non-empty string")
    return list(stops)


def _normalize_stop_token_ids(stop_token_ids: Any) -> list[int]:
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
        raise InvalidRequestError("stop_token_ids", stop_token_ids, "must be a list of token ids or None")
    for token_id in stop_token_ids:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError("stop_token_ids", stop_token_ids, "every id must be an integer >= 0")
    return list(stop_token_ids)
