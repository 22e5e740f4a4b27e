"""The built-in grammar backend: xgrammar (JSON schema, regex, EBNF, choice,
structural tags), compiled against a TokenizerInfo of the model's vocab size."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.structured_output.bitmask import pack_bitmask
from pagedllm.structured_output.interface import Grammar, GrammarBackend, StructuredOutputKind

if TYPE_CHECKING:
    import xgrammar as xgr

    from pagedllm.core.config import StructuredOutputConfig

logger = logging.getLogger(__name__)

# JSON-schema keywords xgrammar ignores silently; a schema using one would be
# enforced only in part, so it is refused instead (vLLM refuses these too).
UNSUPPORTED_JSON_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
    "patternProperties", "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties",
})
# Keywords whose value is a map of name -> schema, a schema, or a list of schemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# A compiled grammar is serialized for the engine core only up to this size in
# memory: the JSON form of one with a large token-mask cache is 10-20 times
# bigger and slower to write than to compile again (measured with 0.2.9: a
# 200-property schema compiles in 0.15 s, 1.3 MB, and serializes to 24 MB in
# 4 s; a `.{0,1000}` pattern compiles in 1 s, 36 KB, and serializes to 43 KB in 2 ms).
MAX_SERIALIZED_GRAMMAR_BYTES = 128 * 1024
# ... and its serialized form only up to this size (it travels with every
# request of that spec to the engine core).
MAX_SERIALIZED_TEXT_BYTES = 1 << 20
# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def unsupported_json_features(schema: Any, path: str = "#") -> list[str]:
    """`"<keyword> at <json pointer>"` for every keyword of UNSUPPORTED_JSON_KEYWORDS,
    in document order.

    NOTE: iterative (a stack of the per-schema generators below, visited in
    the order a recursive walk would), so no nesting depth can overflow it.
    """
    found: list[str] = []
    stack: list[Iterator[tuple[Any, str]]] = [iter([(schema, path)])]
    while stack:
        task = next(stack[-1], None)
        if task is None:
            stack.pop()
        elif isinstance(task[0], dict):
            stack.append(_subschemas(task[0], task[1], found))
    return found


def _subschemas(schema: dict[str, Any], path: str, found: list[str]) -> Iterator[tuple[Any, str]]:
    """Yields each subschema of `schema` with its path; appends the keywords
    of UNSUPPORTED_JSON_KEYWORDS to `found` as it reaches them."""
    for key, value in schema.items():
        if key in UNSUPPORTED_JSON_KEYWORDS and not (key == "uniqueItems" and value is False):
            found.append(f"'{key}' at {path}")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield sub, f"{path}/{key}/{name}"
        elif key in _SCHEMA_VALUES:
            yield value, f"{path}/{key}"
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                yield sub, f"{path}/{key}/{index}"


def choice_to_ebnf(choices: list[str]) -> str:
    # NOTE: json.dumps quotes and escapes exactly as EBNF string literals need.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def clean_error(exc: BaseException) -> str:
    return _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


class XgrammarGrammar(Grammar):
    def __init__(
        self, matcher: xgr.GrammarMatcher, allowed: torch.Tensor | None = None,
        compiled: xgr.CompiledGrammar | None = None,
    ) -> None:
        self.matcher = matcher
        # What the matcher runs on (for `XgrammarBackend.serialize`).
        self.compiled = compiled
        self.num_processed_tokens = 0
        # A packed bitmask row ANDed into every row this grammar fills (see
        # XgrammarBackend.allowed_tokens); None = xgrammar's mask as it is.
        self.allowed = allowed

    def _is_allowed(self, token_id: int) -> bool:
        if self.allowed is None:
            return True
        return bool((int(self.allowed[token_id // 32]) >> (token_id % 32)) & 1)

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                logger.error("request %s: the grammar rejected token %d", request_id, token_id)
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        accepted: list[int] = []
        for token_id in token_ids:
            if not self._is_allowed(token_id) or not self.matcher.accept_token(token_id):
                break
            accepted.append(token_id)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0

    def fork(self) -> XgrammarGrammar:
        forked = XgrammarGrammar(self.matcher.fork(), self.allowed, self.compiled)
        forked.num_processed_tokens = self.num_processed_tokens
        return forked


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, config: StructuredOutputConfig
    ) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id, config)
        import xgrammar as xgr

        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=None if eos_token_id is None else [eos_token_id]
        )
        # NOTE: the manager keeps the LRU cache (hit rate, eviction); a second
        # one inside xgrammar would only hold memory.
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=config.num_compile_threads, cache_enabled=False
        )
        self._allowed_rows: dict[bool, torch.Tensor] = {}

    def allowed_tokens(self, json_text: bool) -> torch.Tensor:
        """Packed bitmask row ANDed into every mask of this backend's grammars.

        Special tokens (chat markers, BOS, padding; not EOS, which ends a
        grammar) are never text: xgrammar takes a special token that the
        tokenizer does not list in all_special_ids for its literal text, so
        "<|im_end|>" could land inside a JSON string and then vanish from the
        detokenized output (or stop a chat). For JSON (`json_text`) also every
        token holding a raw control character but \\n and \\r: xgrammar
        0.2.9 lets \\x00-\\x1f (tab included) into strings with
        minLength/maxLength, which is not JSON, and no JSON text needs them
        (a tab between values can always be a space).
        """
        row = self._allowed_rows.get(json_text)
        if row is None:
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            special = set(getattr(self.tokenizer, "all_special_ids", ()))
            special |= {
                token_id for token_id, token in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                if getattr(token, "special", False)
            }
            for token_id in special - {self.eos_token_id}:
                if 0 <= token_id < self.vocab_size:
                    allowed[token_id] = False
            if json_text:
                for token_id, piece in enumerate(self.tokenizer_info.decoded_vocab[: self.vocab_size]):
                    raw = piece if isinstance(piece, bytes) else str(piece).encode()
                    if any(byte < 0x20 and byte not in (0x0A, 0x0D) for byte in raw):
                        allowed[token_id] = False
            row = self._allowed_rows[json_text] = pack_bitmask(allowed)
        return row

    @classmethod
    def validate(
        cls, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True, max_whitespace: int | None = None
    ) -> None:
        _validate_cached(StructuredOutputKind(kind), spec, any_whitespace, max_whitespace)

    def serialize(self, grammar: Grammar) -> bytes | None:
        assert isinstance(grammar, XgrammarGrammar)
        compiled = grammar.compiled
        if compiled is None or compiled.memory_size_bytes > MAX_SERIALIZED_GRAMMAR_BYTES:
            return None
        data = str(compiled.serialize_json()).encode()
        return data if len(data) <= MAX_SERIALIZED_TEXT_BYTES else None

    def deserialize(self, kind: StructuredOutputKind, spec: str, data: bytes) -> XgrammarGrammar:
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(data.decode(), self.tokenizer_info)
        json_text = StructuredOutputKind(kind) in (StructuredOutputKind.JSON, StructuredOutputKind.JSON_OBJECT)
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.allowed_tokens(json_text), compiled)

    def compile(
        self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True, max_whitespace: int | None = None
    ) -> XgrammarGrammar:
        try:
            return self._compile(StructuredOutputKind(kind), spec, _json_options(any_whitespace, max_whitespace))
        except RuntimeError as exc:  # xgrammar's C++ errors
            raise ValueError(clean_error(exc)) from None

    def _compile(self, kind: StructuredOutputKind, spec: str, json_options: dict[str, Any]) -> XgrammarGrammar:
        import xgrammar as xgr

        compiler = self.compiler
        if kind is StructuredOutputKind.JSON:
            compiled = compiler.compile_json_schema(spec, **json_options)
        elif kind is StructuredOutputKind.JSON_OBJECT:
            compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **json_options)
        elif kind is StructuredOutputKind.REGEX:
            compiled = compiler.compile_regex(spec)
        elif kind is StructuredOutputKind.CHOICE:
            compiled = compiler.compile_grammar(choice_to_ebnf(json.loads(spec)))
        elif kind is StructuredOutputKind.GRAMMAR:
            compiled = compiler.compile_grammar(spec)
        else:
            compiled = compiler.compile_structural_tag(spec)
        json_text = kind in (StructuredOutputKind.JSON, StructuredOutputKind.JSON_OBJECT)
        return XgrammarGrammar(xgr.GrammarMatcher(compiled), self.allowed_tokens(json_text), compiled)


def _json_options(any_whitespace: bool, max_whitespace: int | None) -> dict[str, Any]:
    """xgrammar's whitespace keywords; max_whitespace_cnt only with any_whitespace
    (xgrammar refuses 0: "none" is any_whitespace=False)."""
    if any_whitespace and max_whitespace is not None and max_whitespace > 0:
        return {"any_whitespace": True, "max_whitespace_cnt": max_whitespace}
    return {"any_whitespace": any_whitespace}


@lru_cache(maxsize=256)
def _validate_cached(kind: StructuredOutputKind, spec: str, any_whitespace: bool, max_whitespace: int | None) -> None:
    import xgrammar as xgr

    field = f"structured_outputs.{kind.value}"
    if kind is StructuredOutputKind.JSON:
        unsupported = unsupported_json_features(json.loads(spec))
        if unsupported:
            raise InvalidRequestError(
                field, _short(spec), "the JSON schema uses keywords the xgrammar backend cannot enforce: "
                + ", ".join(unsupported),
            )
    try:
        if kind is StructuredOutputKind.JSON:
            xgr.Grammar.from_json_schema(spec, **_json_options(any_whitespace, max_whitespace))
        elif kind is StructuredOutputKind.REGEX:
            xgr.Grammar.from_regex(spec)
        elif kind is StructuredOutputKind.CHOICE:
            xgr.Grammar.from_ebnf(choice_to_ebnf(json.loads(spec)))
        elif kind is StructuredOutputKind.GRAMMAR:
            xgr.Grammar.from_ebnf(spec)
        elif kind is StructuredOutputKind.STRUCTURAL_TAG:
            xgr.Grammar.from_structural_tag(spec)
    except Exception as exc:  # xgrammar raises RuntimeError / its own types
        what = {
            StructuredOutputKind.JSON: "the JSON schema",
            StructuredOutputKind.REGEX: "the regex",
            StructuredOutputKind.CHOICE: "the choices",
            StructuredOutputKind.GRAMMAR: "the EBNF grammar",
            StructuredOutputKind.STRUCTURAL_TAG: "the structural tag",
        }.get(kind, "the spec")
        raise InvalidRequestError(field, _short(spec), f"{what} does not compile: {clean_error(exc)}") from None


def _short(spec: str, limit: int = 200) -> str:
    return spec if len(spec) <= limit else spec[: limit - 3] + "..."
