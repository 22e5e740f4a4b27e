"""SamplingParams: vLLM's fields and defaults, validated with actionable errors.

SamplingParams and StructuredOutputsParams are msgspec Structs (as vLLM's
SamplingParams is): they cross ZMQ to the engine core and on to the ranks as
themselves, with no dict converters and no field-by-field twins.

Validation runs once, where a user value enters: constructing one
(`SamplingParams(temperature=...)`, as the API, `LLM` and tests do) checks
every field and raises InvalidRequestError with the field, the value and the
limit. msgspec runs `__post_init__` on decode too; the decoders of messages
built from validated params (the engine core's input, a rank's step) decode
inside `trusted_values()`, where msgspec's typed decode (types, unknown
fields) is the only check.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import msgspec

from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.int_limits import INT64_MAX, INT64_MIN, UINT64_MAX, check_int, short_value

if TYPE_CHECKING:
    from pagedllm.structured_output.interface import StructuredOutputKind

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for, per position.
MAX_LOGPROBS = 20
# Most samples one SamplingParams may ask for (the API allows fewer): each is
# an engine request, so this bounds the fan-out of one call.
MAX_N = 1024
# logit_bias: OpenAI's range for a bias, and how many tokens one request may bias.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# Stop strings are searched after every token and token ids matched at every
# step: a list of 50,000 would stall every other request.
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# bad_words: each word bans its last token wherever the rest was just
# generated; checked against every row's output after every step.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# allowed_token_ids: the set a request may sample from (vLLM's Python path
# has no bound; this one keeps the body's validation under ~5 ms of GIL).
MAX_ALLOWED_TOKEN_IDS = 16384
# logprob_token_ids: these tokens' logprobs take the place of the top-k, so
# the bound is logprobs' own (vLLM allows 128).
MAX_LOGPROB_TOKEN_IDS = MAX_LOGPROBS
# Float knobs stay far below float32's max, so the sampler's tensors stay
# finite (-inf / inf and inf * 0 are NaN, and NaN wins argmax).
MAX_TEMPERATURE = 1e6
MAX_REPETITION_PENALTY = 1e6


# True while decoding (or copying) values that were validated where they
# entered; see the module docstring.
_trusted: ContextVar[bool] = ContextVar("pagedllm_trusted_sampling_params", default=False)


@contextmanager
def trusted_values() -> Iterator[None]:
    """Build SamplingParams / StructuredOutputsParams without re-validating:
    for decoding messages built from already validated params."""
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


# The spec fields of StructuredOutputsParams: exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Largest structured_outputs.max_whitespace a request may ask for (as the
# engine's structured_output.max_whitespace: a bound, never a need for more).
MAX_WHITESPACE = 64


def _int_past_64_bits(value: Any) -> int | None:
    """The first integer in a JSON value (dicts and lists, walked without
    recursion: the depth limit is checked later) outside what 64 bits hold."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= UINT64_MAX:
            return item
    return None


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's structured-output request: exactly one of `json` (a JSON schema,
    dict or JSON text), `json_object` (True: any JSON object), `regex`,
    `choice` (list of strings), `grammar` (EBNF, root rule `root`) or
    `structural_tag` (xgrammar's structural-tag JSON, dict or text).

    `disable_any_whitespace`: JSON without free whitespace between tokens.
    `max_whitespace`: the longest whitespace run JSON may have between two
    tokens (0 = none, as disable_any_whitespace); None = the engine's
    `structured_output.max_whitespace`.
    `backend`: a registered grammar backend for this request (default: the
    engine's `structured_output.backend`).

    Size and nesting limits need the engine config, so they are checked by
    `structured_output.limits.check_spec_limits` before the spec is used.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None
    max_whitespace: int | None = None

    def __post_init__(self) -> None:
        if not _trusted.get():
            self._verify()

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """None, a StructuredOutputsParams, or its fields as a dict (as a user may pass them)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = set(cls.__struct_fields__)
            unknown = sorted(set(value) - known)
            if unknown:
                raise InvalidRequestError(
                    "structured_outputs", unknown, "unknown fields; allowed: " + ", ".join(sorted(known))
                )
            return cls(**value)
        raise InvalidRequestError(
            "structured_outputs", short_value(value, 200), "must be a StructuredOutputsParams, a dict or None"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> StructuredOutputsParams:
        # SamplingParams.clone() deep-copies. NOTE: a JSON round trip, not
        # deepcopy: deepcopy spends two Python frames per level and fails at
        # structured_output.max_schema_depth = 512.
        data = {name: getattr(self, name) for name in self.__struct_fields__}
        for name, value in data.items():
            data[name] = json.loads(json.dumps(value)) if isinstance(value, (dict, list)) else value
        with trusted_values():
            return type(self)(**data)

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
            self._verify_json_field(name)
        if self.json_object is not None and self.json_object is not True and self.json_object is not False:
            raise InvalidRequestError("structured_outputs.json_object", self.json_object, "must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"structured_outputs.{name}", short_value(value, 200),
                                          "must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidRequestError("structured_outputs.choice", short_value(self.choice, 200),
                                      "must be a non-empty list of strings")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace", self.disable_any_whitespace,
                                      "must be true or false")
        if self.max_whitespace is not None:
            check_int("structured_outputs.max_whitespace", self.max_whitespace, 0, MAX_WHITESPACE)
        if self.backend is not None and not (isinstance(self.backend, str) and self.backend):
            raise InvalidRequestError("structured_outputs.backend", self.backend,
                                      "must be a registered grammar backend name or None")

    def _verify_json_field(self, name: str) -> None:
        value = getattr(self, name)
        if value is None:
            return
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except RecursionError:
                # NOTE: nested past the parser: check_spec_limits (run before
                # the spec is used) refuses it naming structured_output.max_schema_depth.
                return
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs.{name}", short_value(value, 200),
                                          f"not valid JSON: {exc}") from None
        allowed = (dict, bool) if name == "json" else (dict,)
        if not isinstance(value, allowed):
            # No repr of the value: a list nested 10,000 deep would not repr().
            raise InvalidRequestError(f"structured_outputs.{name}", f"<{type(value).__name__}>",
                                      "must be a JSON object (dict or JSON text)")
        wide = _int_past_64_bits(getattr(self, name))
        if wide is not None:  # a dict travels to the engine core as it is: its wire format has 64-bit ints
            raise InvalidRequestError(f"structured_outputs.{name}", short_value(wide, 60),
                                      f"integers in a JSON object between {INT64_MIN} and {UINT64_MAX}")

    def grammar_spec(self) -> tuple[StructuredOutputKind, str]:
        """(kind, spec text): the same spec gives the same text (the cache key).
        NOTE: recursive (json); call it after check_spec_limits."""
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


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
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
    # a dict of its fields is turned into StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    # token id -> bias added to its logit before any sampling step (OpenAI's
    # logit_bias, in [-100, 100]); None (or empty) = no bias.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None = all.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): the last token of a word is
    # banned whenever the tokens before it were just generated. The input
    # processor tokenizes them (with and without a leading space) into
    # bad_words_token_ids, which is what the sampler reads.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Logprobs of exactly these token ids at every sampled position, in place
    # of the top-`logprobs` (vLLM's logprob_token_ids); `logprobs` must be
    # None or their count.
    logprob_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (-1: the last max_model_len - 1,
    # "left"), or the first k ("right"); None = no truncation.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"

    def __post_init__(self) -> None:
        if _trusted.get():
            return
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalize_token_ids("allowed_token_ids", self.allowed_token_ids,
                                                      MAX_ALLOWED_TOKEN_IDS, allow_empty=False)
        self.logprob_token_ids = _normalize_token_ids("logprob_token_ids", self.logprob_token_ids,
                                                      MAX_LOGPROB_TOKEN_IDS, allow_empty=False)
        self.bad_words = _normalize_bad_words(self.bad_words)
        self.bad_words_token_ids = _normalize_bad_words_token_ids(self.bad_words_token_ids)
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
        # NOTE: every int is range-checked: these values cross msgpack (int64 /
        # uint64), become tensors and seed generators; none may overflow them.
        check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, lambda v: 0.0 <= v <= MAX_TEMPERATURE,
                      f"must be >= 0 and <= {MAX_TEMPERATURE:.0f}")
        _check_number("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        # A top_k above the vocabulary keeps every token (the sampler clamps it).
        check_int("top_k", self.top_k, -1, INT64_MAX,
                  f"must be -1 or 0 (disabled) or a positive integer <= {INT64_MAX}")
        _check_number("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: 0.0 < v <= MAX_REPETITION_PENALTY,
                      f"must be > 0 and <= {MAX_REPETITION_PENALTY:.0f}")
        if self.seed is not None:
            # int64 as vLLM; children's seed + index wraps inside it (for_child).
            check_int("seed", self.seed, INT64_MIN, INT64_MAX,
                      f"must be None or an integer in [{INT64_MIN}, {INT64_MAX}]")
        self._verify_counts()
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidRequestError("extra_args", short_value(self.extra_args), "must be a dict or None")

    def _verify_counts(self) -> None:
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, INT64_MAX,
                      f"must be None or an integer in [1, {INT64_MAX}]")
        check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", self.min_tokens,
                                      f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, 0, MAX_LOGPROBS, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.logprob_token_ids is not None and self.logprobs is not None \
                and self.logprobs != len(self.logprob_token_ids):
            raise InvalidRequestError(
                "logprob_token_ids", f"<{len(self.logprob_token_ids)} ids>",
                f"logprobs ({self.logprobs}) must be None or the number of logprob_token_ids",
            )
        if self.truncate_prompt_tokens is not None:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, INT64_MAX,
                      f"must be None, -1 (the context's length) or an integer in [1, {INT64_MAX}]")
            if self.truncate_prompt_tokens == 0:
                raise InvalidRequestError("truncate_prompt_tokens", 0, "must be None, -1 or at least 1")
        if self.truncation_side not in ("left", "right"):
            raise InvalidRequestError("truncation_side", short_value(self.truncation_side), "must be 'left' or 'right'")

    @property
    def num_logprobs(self) -> int | None:
        """Logprobs per sampled position besides the sampled token's: `logprobs`,
        or the number of `logprob_token_ids`; None when none were asked for."""
        if self.logprob_token_ids is not None:
            return len(self.logprob_token_ids)
        return self.logprobs

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
        with trusted_values():
            return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params of sample `index` of an `n > 1` request: n=1 and, when seeded,
        seed + index (as vLLM), so siblings differ but stay reproducible."""
        child = self.clone()
        child.n = 1
        if child.seed is not None:
            # Wraps around inside int64 so seed = INT64_MAX still has valid children.
            child.seed = (child.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        return child

    def validate_against(self, max_model_len: int, num_prompt_tokens: int, vocab_size: int | None = None) -> int:
        """Check the request fits the context (and, given `vocab_size`, that
        every token id it names exists); returns the effective max_tokens."""
        if vocab_size is not None:
            self.validate_vocab(vocab_size)
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

    def validate_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary: an id past it would
        index past the logits (the sampler drops such ids rather than crash)."""
        for token_id in self.stop_token_ids or ():
            check_int("stop_token_ids", token_id, 0, vocab_size - 1, f"token ids must be in [0, {vocab_size})")
        for token_id in self.logit_bias or {}:
            check_int("logit_bias", token_id, 0, vocab_size - 1, f"keys must be token ids in [0, {vocab_size})")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            for token_id in getattr(self, name) or ():
                check_int(name, token_id, 0, vocab_size - 1,
                          f"token ids must be in [0, {vocab_size}) (the vocabulary size is {vocab_size})")
        for word_token_ids in self.bad_words_token_ids or ():
            for token_id in word_token_ids:
                check_int("bad_words", token_id, 0, vocab_size - 1, f"token ids must be in [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise InvalidRequestError(name, value, f"must be <= the vocabulary size ({vocab_size})")


def _check_number(name: str, value: Any, ok: Callable[[float], bool], limit: str) -> None:
    # NaN and inf fail every range check; bool is not a number here; an int
    # too large for a float fails like inf instead of raising OverflowError.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, short_value(value), limit)
    try:
        number = float(value)
    except OverflowError:
        raise InvalidRequestError(name, short_value(value), limit) from None
    if not math.isfinite(number) or not ok(number):
        raise InvalidRequestError(name, short_value(value), limit)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise InvalidRequestError("stop", short_value(stop), "must be a string, a list of strings or None")
    _check_strings("stop", stops, "stop string", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
    return list(stops)


def _check_strings(field: str, strings: list[Any] | tuple[Any, ...], noun: str, max_count: int, max_chars: int) -> None:
    """A bounded list of non-empty bounded strings (stop strings, bad words)."""
    if len(strings) > max_count:
        raise InvalidRequestError(field, f"<{len(strings)} {noun}s>", f"at most {max_count} {noun}s")
    for string in strings:
        if not isinstance(string, str) or not string:
            raise InvalidRequestError(field, short_value(string), f"every {noun} must be a non-empty string")
        if len(string) > max_chars:
            raise InvalidRequestError(field, f"<a {noun} of {len(string)} characters>",
                                      f"each {noun} has at most {max_chars} characters")


def _normalize_stop_token_ids(stop_token_ids: Any) -> list[int]:
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
        raise InvalidRequestError("stop_token_ids", short_value(stop_token_ids), "must be a list of token ids or None")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError("stop_token_ids", f"<{len(stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
    for token_id in stop_token_ids:
        check_int("stop_token_ids", token_id, 0, INT64_MAX, f"every id must be an integer in [0, {INT64_MAX}]")
    return list(stop_token_ids)


def _normalize_logit_bias(logit_bias: Any) -> dict[int, float] | None:
    """{token id: bias} with float biases; None when empty. Ids are checked
    against the vocabulary later (validate_vocab), when it is known."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise InvalidRequestError("logit_bias", short_value(logit_bias), "must be a dict {token id: bias} or None")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("logit_bias", f"<{len(logit_bias)} entries>",
                                  f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    normalized: dict[int, float] = {}
    for token_id, bias in logit_bias.items():
        check_int("logit_bias", token_id, 0, INT64_MAX, f"keys must be token ids (integers in [0, {INT64_MAX}])")
        _check_number("logit_bias", bias, lambda v: -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                      f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        normalized[token_id] = float(bias)
    return normalized or None


def _normalize_token_ids(field: str, token_ids: Any, max_ids: int, allow_empty: bool) -> list[int] | None:
    """A list of token ids (ints in int64; the vocabulary is checked later, by
    validate_vocab), at most `max_ids` of them, or None."""
    if token_ids is None:
        return None
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidRequestError(field, short_value(token_ids), "must be a list of token ids or None")
    if not token_ids and not allow_empty:
        raise InvalidRequestError(field, [], "must not be empty (omit it instead)")
    if len(token_ids) > max_ids:
        raise InvalidRequestError(field, f"<{len(token_ids)} ids>", f"at most {max_ids} ids")
    for token_id in token_ids:
        check_int(field, token_id, 0, INT64_MAX, f"every id must be an integer in [0, {INT64_MAX}]")
    return list(token_ids)


def _normalize_bad_words(bad_words: Any) -> list[str] | None:
    """Distinct non-empty strings, in order (vLLM drops repeats); None when none."""
    if bad_words is None:
        return None
    if not isinstance(bad_words, (list, tuple)):
        raise InvalidRequestError("bad_words", short_value(bad_words), "must be a list of strings or None")
    _check_strings("bad_words", bad_words, "word", MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
    return list(dict.fromkeys(bad_words)) or None


def _normalize_bad_words_token_ids(token_ids: Any) -> list[list[int]] | None:
    """The tokenized bad words (two forms per word at most), as the core gets them."""
    if token_ids is None:
        return None
    if not isinstance(token_ids, (list, tuple)) or len(token_ids) > 2 * MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words_token_ids", short_value(token_ids),
                                  f"must be a list of at most {2 * MAX_BAD_WORDS} token id lists")
    return [
        # A character is at most 4 byte-level tokens.
        _normalize_token_ids("bad_words_token_ids", word, 4 * MAX_BAD_WORD_CHARS, allow_empty=False) or []
        for word in token_ids
    ] or None
