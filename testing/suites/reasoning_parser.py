"""Conformance suite of the ``reasoning_parser`` kind.

Replies are scripted with the parser's own tags (``start_tag`` /
``end_tag``) over the shipped tokenizer, in two spellings: the tags as added
tokens (as reasoning models ship them) and the tags spelt in ordinary BPE
pieces, so a tag is cut across deltas. Streaming is replayed the way the
server does it: token-id deltas of random sizes, each delta's text the
decoded difference.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

from pagedllm.reasoning.interface import ReasoningParser
from pagedllm.testing.suite import ConformanceError, Suite

SUITE = Suite("reasoning_parser")

NUM_RANDOM_CUTS = 8
REASONINGS = ["Let me see. 2 + 2 is 4.", "x", "A < B and C > D; so </b> is not a tag."]
CONTENTS = ["The answer is 4.", "", '{"answer": 4}']


def _parser_class(name: str) -> type[ReasoningParser]:
    from pagedllm.reasoning.select import reasoning_parser_class

    return reasoning_parser_class(name)


@functools.cache
def _tokenizer(start_tag: str, end_tag: str, tags_as_tokens: bool) -> Any:
    from pagedllm.model_registry.tiny import get_tokenizer_dir
    from pagedllm.model_registry.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(get_tokenizer_dir()))
    if tags_as_tokens:
        tokenizer.add_tokens([start_tag, end_tag])
    return tokenizer


def _parser(name: str, tags_as_tokens: bool, rule: str) -> ReasoningParser:
    cls = _parser_class(name)
    try:
        return cls(_tokenizer(cls.start_tag, cls.end_tag, tags_as_tokens))
    except Exception as exc:
        raise ConformanceError(rule, f"{name}: building the parser failed: {type(exc).__name__}: {exc}") from exc


def _cases(parser: ReasoningParser) -> list[tuple[str, str, str | None]]:
    """(reply, reasoning, content) triples: start tag present or absent, end
    tag present (content after it, or none) or absent (all reasoning)."""
    start, end = parser.start_tag, parser.end_tag
    cases: list[tuple[str, str, str | None]] = []
    for reasoning in REASONINGS:
        for content in CONTENTS:
            cases.append((f"{start}{reasoning}{end}{content}", reasoning, content or None))
            cases.append((f"{reasoning}{end}{content}", reasoning, content or None))
        cases.append((f"{start}{reasoning}", reasoning, None))
        cases.append((reasoning, reasoning, None))
    return cases


def _stream(parser: ReasoningParser, reply: str, rng: random.Random, rule: str) -> tuple[str, str, list[str]]:
    """Replay `reply` as random token deltas; (reasoning, content, every piece sent)."""
    tokenizer = parser.tokenizer
    token_ids = tokenizer.encode(reply, add_special_tokens=False)
    whole_reasoning, whole_content = parser.extract_reasoning_content(reply)
    reasoning, content, pieces = "", "", []
    previous_text, previous_ids = "", list[int]()
    position = 0
    while position < len(token_ids):
        position = min(len(token_ids), position + rng.randint(1, 3))
        current_ids = token_ids[:position]
        current_text = tokenizer.decode(current_ids)
        delta = parser.extract_reasoning_content_streaming(
            previous_text, current_text, current_text[len(previous_text) :],
            previous_ids, current_ids, current_ids[len(previous_ids) :],
        )
        if delta is not None:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            pieces += [piece for piece in (delta.reasoning_content, delta.content) if piece]
        if not (whole_reasoning or "").startswith(reasoning) or not (whole_content or "").startswith(content):
            raise ConformanceError(
                rule, f"streaming {reply!r} sent reasoning {reasoning!r} / content {content!r}, which the whole "
                f"reply's split ({whole_reasoning!r}, {whole_content!r}) does not start with",
            )
        previous_text, previous_ids = current_text, current_ids
    held_back = len(whole_reasoning or "") - len(reasoning)
    if content != (whole_content or "") or held_back >= len(parser.end_tag):
        raise ConformanceError(
            rule, f"streaming {reply!r} ended having sent reasoning {reasoning!r} / content {content!r} of "
            f"({whole_reasoning!r}, {whole_content!r}): only a possible tag may be held back",
        )
    return reasoning, content, pieces


def _check_split(name: str, tags_as_tokens: bool, rule: str) -> None:
    parser = _parser(name, tags_as_tokens, rule)
    for reply, reasoning, content in _cases(parser):
        got = parser.extract_reasoning_content(reply)
        if got != (reasoning, content):
            raise ConformanceError(rule, f"{name}: {reply!r} split as {got!r}, expected {(reasoning, content)!r}")


def _check_streaming(name: str, tags_as_tokens: bool, rule: str) -> None:
    parser = _parser(name, tags_as_tokens, rule)
    rng = random.Random(0)
    for reply, _, _ in _cases(parser):
        for _ in range(NUM_RANDOM_CUTS):
            _, _, pieces = _stream(parser, reply, rng, rule)
            leaked = [piece for piece in pieces if parser.start_tag in piece or parser.end_tag in piece]
            if leaked:
                raise ConformanceError(rule, f"{name}: streaming {reply!r} sent a tag in {leaked!r}")


def _rule(rule: str, check: Callable[[str, bool, str], None], tags_as_tokens: bool, doc: str) -> None:
    def run(name: str) -> None:
        check(name, tags_as_tokens, rule)

    run.__doc__ = doc
    SUITE.rule(rule)(run)


_rule("split-exact", _check_split, True,
      "A whole reply splits into exactly its reasoning and content: start tag present or absent, end tag "
      "present (content after it, or none) or absent (all reasoning).")
_rule("streaming-prefix-of-whole", _check_streaming, True,
      "Streamed in random token deltas, what has been sent is always a prefix of the whole reply's split, "
      "no piece holds a tag, and at the end at most a possible tag is held back.")
_rule("tag-split-across-deltas", _check_streaming, False,
      "The same, with each tag spelt in several tokens, so deltas cut tags apart.")


@SUITE.rule("token-ids")
def check_token_ids(name: str) -> None:
    """is_reasoning_end holds exactly once the end tag is generated (and not
    after a later start tag); extract_content_ids is the answer's ids."""
    rule = "token-ids"
    parser = _parser(name, True, rule)
    tokenizer = parser.tokenizer
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    reasoning_ids, content_ids = encode(REASONINGS[0]), encode(CONTENTS[0])
    start_ids, end_ids = encode(parser.start_tag), encode(parser.end_tag)
    expectations: list[tuple[list[int], bool, list[int] | None]] = [
        (start_ids + reasoning_ids, False, []),
        (reasoning_ids, False, []),
        (start_ids + reasoning_ids + end_ids, True, []),
        (reasoning_ids + end_ids + content_ids, True, content_ids),
        (start_ids + reasoning_ids + end_ids + content_ids, True, content_ids),
        # A prompt whose earlier turn reasoned, then a section opened again.
        (start_ids + reasoning_ids + end_ids + content_ids + start_ids, False, None),
    ]
    for token_ids, ended, expected_content in expectations:
        if parser.is_reasoning_end(token_ids) != ended:
            raise ConformanceError(
                rule, f"{name}: is_reasoning_end({tokenizer.decode(token_ids)!r}) is not {ended}"
            )
        if expected_content is not None and parser.extract_content_ids(token_ids) != expected_content:
            raise ConformanceError(
                rule, f"{name}: extract_content_ids({tokenizer.decode(token_ids)!r}) = "
                f"{parser.extract_content_ids(token_ids)}, expected {expected_content}",
            )


__all__ = ["SUITE"]
