"""A GrammarBackend over llguidance (https://github.com/guidance-ai/llguidance):
JSON schema, any JSON object, regex, choice and EBNF/GBNF or Lark grammars.

llguidance computes masks lazily from a token trie (no ahead-of-time
compilation per token), so `compile` is cheap and the cost moves to
`fill_bitmask`; its bitmask layout is xgrammar's, which pagedllm shares.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.structured_output.interface import Grammar, GrammarBackend, StructuredOutputKind

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import StructuredOutputConfig


def grammar_text(kind: StructuredOutputKind, spec: str, any_whitespace: bool, max_whitespace: int | None = None) -> str:
    """The llguidance grammar (its JSON form) for a pagedllm spec."""
    kind = StructuredOutputKind(kind)
    options: dict[str, Any] = {"whitespace_flexible": any_whitespace}
    if any_whitespace and max_whitespace:
        # JSON's four whitespace characters, at most `max_whitespace` in a run.
        options["whitespace_pattern"] = f"[\\x20\\x0A\\x0D\\x09]{{0,{max_whitespace}}}"
    if kind is StructuredOutputKind.JSON:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=options)
    if kind is StructuredOutputKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
    if kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is StructuredOutputKind.CHOICE:
        return llguidance.grammar_from("choice", json.loads(spec))
    if kind is StructuredOutputKind.GRAMMAR:
        return llguidance.grammar_from("grammar", spec)  # GBNF/EBNF or Lark
    raise ValueError(f"the guidance backend does not support {kind.value}")


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int | None) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self._initial = matcher.deep_copy()
        # Accepted tokens, so is_terminated survives a rollback past the EOS.
        self.accepted: list[int] = []

    def _num_valid(self, token_ids: list[int]) -> int:
        num_valid = self.matcher.validate_tokens(token_ids)
        # llguidance's validate_tokens never counts EOS; it is valid where the
        # grammar accepts (checked at the end of the valid prefix).
        if num_valid < len(token_ids) and token_ids[num_valid] == self.eos_token_id:
            if num_valid and not self.matcher.consume_tokens(token_ids[:num_valid]):
                raise RuntimeError(f"llguidance: {self.matcher.get_error()}")
            accepting = self.matcher.is_accepting()
            if num_valid:
                self.matcher.rollback(num_valid)
            num_valid += int(accepting)
        return num_valid

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        # NOTE: an invalid token would put the matcher in a permanent error
        # state, so only the valid prefix is consumed.
        token_ids = list(token_ids)
        num_valid = self._num_valid(token_ids)
        for token_id in token_ids[:num_valid]:
            # NOTE: one at a time: a stopped matcher takes EOS from consume_token only.
            if not self.matcher.consume_token(token_id):
                raise RuntimeError(f"request {request_id}: llguidance: {self.matcher.get_error()}")
        self.accepted.extend(token_ids[:num_valid])
        return num_valid == len(token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        token_ids = list(token_ids)
        return token_ids[: self._num_valid(token_ids)]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        kept = self.accepted[:-num_tokens]
        if self.is_terminated():
            # llguidance does not count a consumed EOS in its rollback history
            # and stays stopped: replay the kept tokens on a fresh matcher.
            self.matcher = self._initial.deep_copy()
            if kept and not self.matcher.consume_tokens(kept):
                raise RuntimeError(f"llguidance: {self.matcher.get_error()}")
        else:
            self.matcher.rollback(num_tokens)
        self.accepted = kept

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        # The contract: terminated once the stop token is accepted (llguidance's
        # is_stopped() is already true when only EOS may follow).
        return bool(self.accepted) and self.accepted[-1] == self.eos_token_id and self.matcher.is_stopped()

    def reset(self) -> None:
        self.matcher = self._initial.deep_copy()
        self.accepted = []

    def fork(self) -> GuidanceGrammar:
        forked = GuidanceGrammar(self.matcher.deep_copy(), self.eos_token_id)
        forked._initial = self._initial
        forked.accepted = list(self.accepted)
        return forked


class GuidanceBackend(GrammarBackend):
    name = "guidance"
    supported_kinds = frozenset(StructuredOutputKind) - {StructuredOutputKind.STRUCTURAL_TAG}

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, config: StructuredOutputConfig
    ) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_id, config)
        # n_vocab = the MODEL's vocab: mask rows are as wide as the logits.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        if self.eos_token_id is None:
            self.eos_token_id = self.ll_tokenizer.eos_token

    # NOTE: naming `max_whitespace` in validate/compile is what opts in: plugin
    # API >= 1.1 passes it (bounded JSON whitespace), 1.0 never does.
    @classmethod
    def validate(
        cls, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True, max_whitespace: int | None = None
    ) -> None:
        kind = StructuredOutputKind(kind)
        field = f"structured_outputs.{kind.value}"
        if kind not in cls.supported_kinds:
            raise InvalidRequestError(field, spec[:200], "the guidance backend does not support this kind")
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_text(kind, spec, any_whitespace, max_whitespace))
        except ValueError as exc:
            error = str(exc)
        if error:
            raise InvalidRequestError(field, spec[:200], f"llguidance cannot compile it: {error}")

    def compile(
        self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True, max_whitespace: int | None = None
    ) -> GuidanceGrammar:
        grammar = grammar_text(kind, spec, any_whitespace, max_whitespace)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance cannot compile the {StructuredOutputKind(kind).value}: {matcher.get_error()}")
        return GuidanceGrammar(matcher, self.eos_token_id)
