"""The grammar backend suite: the bitmask says exactly what the grammar says.

The backend is built for the shipped tiny model's tokenizer (a small byte-level
BPE) with a vocabulary padded past the tokenizer (as a model's logits often
are). For each spec kind it declares among regex, choice and JSON schema, a
corpus of probe strings, some in the language and some not, is fed token by
token; at every step the bitmask, `validate_tokens` and `accept_tokens` must
agree, and the string must be accepted (every token allowed, then EOS
allowed) exactly when Python says it is in the language.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from typing import Any

from pagedllm.testing.components import load, registration
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "grammar_backend"
SUITE = Suite(KIND)

PADDING = 37  # logits columns past the tokenizer: never allowed

REGEX = r"(cat|dog)s?( [0-9]{1,2})?"
CHOICES = ["red", "green", "blue"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _schema_holds(text: str) -> bool:
    # NOTE: compiled with any_whitespace=True (backends differ on what "no
    # whitespace" means: xgrammar keeps ", " and ": "); no probe has leading
    # or trailing whitespace, which backends also treat differently.
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"a"} and type(value["a"]) is int


# kind -> (spec, corpus of probes, is a probe in the language)
CORPORA: dict[str, tuple[str, list[str], Callable[[str], bool]]] = {
    "regex": (
        REGEX,
        ["cat", "dogs", "cats 12", "dog 7", "dog 123", "cow", "cat ", "", "dogss", "cats12", "catdog"],
        lambda text: re.fullmatch(REGEX, text) is not None,
    ),
    "choice": (json.dumps(CHOICES), ["red", "green", "blue", "gre", "blue!", "yellow", "redgreen", ""],
               lambda text: text in CHOICES),
    "json": (
        json.dumps(SCHEMA),
        ['{"a":1}', '{"a": -42}', '{"a":"x"}', "{}", '{"a": 1, "b": 2}', '{"a":1.5}', '{"a":1', '{"b":1}', "[1]"],
        _schema_holds,
    ),
}


class _Harness:
    """The backend under test, built for the tiny tokenizer."""

    def __init__(self, rule: str, name: str) -> None:
        from transformers import AutoTokenizer

        from pagedllm.core.config import StructuredOutputConfig
        from pagedllm.model_registry.tiny import get_tokenizer_dir

        info = registration(rule, KIND, name).info
        missing = [p for p in info.requires if importlib.util.find_spec(p) is None]
        if missing:
            raise RuleSkipped(rule, f"grammar backend {name!r} requires {', '.join(missing)}, not installed")
        self.rule = rule
        self.tokenizer = AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))
        self.vocab_size = len(self.tokenizer) + PADDING
        self.eos = self.tokenizer.eos_token_id
        cls = load(rule, KIND, name)
        try:
            self.backend = cls(self.tokenizer, self.vocab_size, self.eos, StructuredOutputConfig())
        except Exception as exc:
            raise ConformanceError(rule, f"the backend did not build: {type(exc).__name__}: {exc}") from exc
        declared = info.kinds
        self.kinds = [k for k in CORPORA if declared is None or k in declared]
        if not self.kinds:
            raise RuleSkipped(rule, f"{name!r} compiles none of {', '.join(CORPORA)}")

    def compile(self, kind: str) -> Any:
        from pagedllm.structured_output.interface import StructuredOutputKind

        spec = CORPORA[kind][0]
        try:
            return self.backend.compile(StructuredOutputKind(kind), spec, any_whitespace=True)
        except Exception as exc:
            raise ConformanceError(self.rule, f"compile({kind}, {spec!r}) raised {type(exc).__name__}: {exc}") from exc

    def allowed(self, grammar: Any) -> Any:
        """The bitmask row as a bool tensor [vocab_size]."""
        import torch

        bitmask = self.backend.allocate_bitmask(1, self.vocab_size)
        bitmask.fill_(0)
        grammar.fill_bitmask(bitmask, 0)
        words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
        bits = (words[:, None] >> torch.arange(32)) & 1
        return bits.flatten()[: self.vocab_size].bool()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _walk(harness: _Harness, kind: str, grammar: Any, text: str) -> bool:
    """Feed ``text`` token by token while the bitmask allows it; True when
    every token and then EOS are allowed. A token the bitmask allows must be
    taken by validate_tokens and accept_tokens (else a sampled token would
    fail its request). NOTE: not the converse: a backend may mask tokens its
    matcher would take (llguidance masks non-canonical tokenizations)."""
    rule = harness.rule
    for token in harness.encode(text):
        allowed = harness.allowed(grammar)
        if bool(allowed[len(harness.tokenizer):].any()):
            raise ConformanceError(rule, f"{kind}: ids past the tokenizer ({len(harness.tokenizer)}) are allowed")
        if not allowed[token]:
            return False
        if list(grammar.validate_tokens([token])) != [token]:
            raise ConformanceError(rule, f"{kind} {text!r}: token {token} is allowed but validate_tokens refused it")
        if not grammar.accept_tokens("conformance", [token]):
            raise ConformanceError(rule, f"{kind} {text!r}: token {token} is allowed but accept_tokens refused it")
    return bool(harness.allowed(grammar)[harness.eos])


@SUITE.rule("bitmask-accepts-exactly-the-language")
def check_bitmask(name: str) -> None:
    """Each probe of each declared kind is accepted (tokens, then EOS) exactly when it is in the language."""
    rule = "bitmask-accepts-exactly-the-language"
    harness = _Harness(rule, name)
    for kind in harness.kinds:
        _, probes, holds = CORPORA[kind]
        compiled = harness.compile(kind)
        for text in probes:
            accepted = _walk(harness, kind, compiled.fork(), text)
            if accepted != holds(text):
                raise ConformanceError(
                    rule, f"{kind} {CORPORA[kind][0]}: {text!r} is {'' if holds(text) else 'not '}in the language, "
                          f"but the grammar {'accepted' if accepted else 'rejected'} it"
                )


@SUITE.rule("rollback")
def check_rollback(name: str) -> None:
    """rollback(n) after n accepted tokens gives back the earlier bitmask, and the same tokens are accepted again;
    validate_tokens changes nothing."""
    import torch

    rule = "rollback"
    harness = _Harness(rule, name)
    for kind in harness.kinds:
        _, probes, holds = CORPORA[kind]
        text = max((p for p in probes if holds(p)), key=lambda p: len(harness.encode(p)))
        tokens = harness.encode(text)
        grammar = harness.compile(kind).fork()
        masks = [harness.allowed(grammar)]
        for token in tokens:
            grammar.validate_tokens(tokens)
            if not torch.equal(harness.allowed(grammar), masks[-1]):
                raise ConformanceError(rule, f"{kind}: validate_tokens changed the grammar's state")
            if not grammar.accept_tokens("conformance", [token]):
                raise ConformanceError(rule, f"{kind} {text!r}: accept_tokens refused token {token} of the language")
            masks.append(harness.allowed(grammar))
        for back in range(1, len(tokens) + 1):
            grammar.rollback(back)
            if not torch.equal(harness.allowed(grammar), masks[len(tokens) - back]):
                raise ConformanceError(rule, f"{kind} {text!r}: after rollback({back}) the bitmask is another")
            if not grammar.accept_tokens("conformance", tokens[len(tokens) - back :]):
                raise ConformanceError(rule, f"{kind} {text!r}: after rollback({back}) the same tokens were refused")
        if not torch.equal(harness.allowed(grammar), masks[-1]):
            raise ConformanceError(rule, f"{kind} {text!r}: re-accepting after rollbacks ends in another state")


@SUITE.rule("termination")
def check_termination(name: str) -> None:
    """A grammar is terminated only once it accepted EOS after a whole string;
    EOS is refused mid-string; reset() and fork() give independent fresh states."""
    import torch

    rule = "termination"
    harness = _Harness(rule, name)
    for kind in harness.kinds:
        _, probes, holds = CORPORA[kind]
        text = next(p for p in probes if holds(p) and len(harness.encode(p)) > 1)
        tokens = harness.encode(text)
        compiled = harness.compile(kind)
        initial = harness.allowed(compiled)
        grammar = compiled.fork()
        grammar.accept_tokens("conformance", tokens[:1])
        if grammar.is_terminated():
            raise ConformanceError(rule, f"{kind}: terminated after one token of {text!r}")
        if not torch.equal(harness.allowed(compiled), initial):
            raise ConformanceError(rule, f"{kind}: advancing a fork changed the grammar it was forked from")
        head = str(harness.tokenizer.decode(tokens[:1]))
        if harness.allowed(grammar)[harness.eos] and not holds(head):
            raise ConformanceError(rule, f"{kind}: EOS allowed after an incomplete {head!r}")
        grammar.accept_tokens("conformance", tokens[1:])
        if grammar.is_terminated():
            raise ConformanceError(rule, f"{kind}: terminated before EOS after {text!r}")
        if not grammar.accept_tokens("conformance", [harness.eos]) or not grammar.is_terminated():
            raise ConformanceError(rule, f"{kind}: EOS after the whole {text!r} did not terminate the grammar")
        grammar.reset()
        if grammar.is_terminated() or not torch.equal(harness.allowed(grammar), initial):
            raise ConformanceError(rule, f"{kind}: reset() did not return to the initial state")
