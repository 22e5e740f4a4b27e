"""The reasoning-parser plugin kind: the built-in `think` parser (exact
splits, tags cut across deltas, token-id predicates), the server's streaming
bookkeeping, the conformance suite (the built-in passes; broken parsers fail
the rule they break), selection by name, and the structured-output gate
(no bitmask rows and no grammar advance before the end of reasoning; a draft
that ends it is followed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from helpers.scripted_model import scripted_tokenizer

from pagedllm.core.config import EngineConfig, StructuredOutputConfig
from pagedllm.core.errors import ConfigError
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, split_reply
from pagedllm.plugins import get_plugin_manager, hookimpl
from pagedllm.reasoning.interface import DeltaReasoning
from pagedllm.reasoning.select import build_reasoning_parser, reasoning_parser_class
from pagedllm.reasoning.think import ThinkReasoningParser
from pagedllm.structured_output.bitmask import unpack_bitmask
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.testing.suite import ConformanceError, run_suite

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shipped tokenizer with <think> and </think> as (non-special) added tokens."""
    return scripted_tokenizer(tmp_path_factory.mktemp("tokenizer"), ["<think>", "</think>"])


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shipped tokenizer alone: each tag is four BPE pieces."""
    return scripted_tokenizer(tmp_path_factory.mktemp("plain"), [])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------ think parser


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<think>Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),
        ("Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),  # the template opened <think>
        ("<think>Let me see.", ("Let me see.", None)),  # cut short: all reasoning
        ("Let me see.", ("Let me see.", None)),
        ("<think>Let me see.</think>", ("Let me see.", None)),
        ("<think></think>It is 4.", (None, "It is 4.")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    ],
)
def test_think_splits_whole_replies(tokenizer: Any, reply: str, expected: tuple[str | None, str | None]) -> None:
    assert ThinkReasoningParser(tokenizer).extract_reasoning_content(reply) == expected


def _stream_text(parser: ThinkReasoningParser, deltas: list[str]) -> list[DeltaReasoning | None]:
    pieces, text = [], ""
    for delta in deltas:
        pieces.append(parser.extract_reasoning_content_streaming(text, text + delta, delta, [], [], []))
        text += delta
    return pieces


def test_think_streaming_holds_back_an_end_tag_cut_across_deltas(tokenizer: Any) -> None:
    parser = ThinkReasoningParser(tokenizer)
    pieces = _stream_text(parser, ["<thi", "nk>Let me", " see.</th", "ink", ">It ", "is 4."])
    assert pieces == [
        None,  # "<thi" may be the start tag
        DeltaReasoning(reasoning_content="Let me"),
        DeltaReasoning(reasoning_content=" see."),  # "</th" held back
        None,  # "</think" still may be the end tag
        DeltaReasoning(content="It "),
        DeltaReasoning(content="is 4."),
    ]


def test_think_streaming_releases_text_that_was_not_a_tag(tokenizer: Any) -> None:
    parser = ThinkReasoningParser(tokenizer)
    assert _stream_text(parser, ["a </", "b> c"]) == [DeltaReasoning("a "), DeltaReasoning("</b> c")]


def test_server_stream_flushes_a_held_back_tail_at_the_end(tokenizer: Any) -> None:
    stream = ReasoningStream(ThinkReasoningParser(tokenizer))
    assert stream.delta("<think>2 is less than 3, so 2 <", [], finished=False) == DeltaReasoning(
        "2 is less than 3, so 2 "
    )
    # The reply ends on "<": it was no tag after all.
    assert stream.delta("", [], finished=True) == DeltaReasoning("<")
    assert (stream.sent_reasoning, stream.sent_content) == ("2 is less than 3, so 2 <", "")
    assert split_reply(None, "<think>a</think>b") == (None, "<think>a</think>b")  # no parser: all content


def test_think_token_ids_with_single_token_tags(tokenizer: Any) -> None:
    parser = ThinkReasoningParser(tokenizer)
    start, end = _encode(tokenizer, "<think>"), _encode(tokenizer, "</think>")
    assert len(start) == len(end) == 1
    reasoning, content = _encode(tokenizer, "Let me see."), _encode(tokenizer, "It is 4.")
    assert not parser.is_reasoning_end(start + reasoning)
    assert parser.is_reasoning_end(start + reasoning + end)
    assert parser.is_reasoning_end(reasoning + end + content)
    # A prompt whose earlier turn reasoned and whose template opens a new section.
    assert not parser.is_reasoning_end(start + reasoning + end + content + start)
    assert parser.extract_content_ids(start + reasoning + end + content) == content
    assert parser.extract_content_ids(start + reasoning) == []


def test_think_token_ids_with_tags_spelt_in_pieces(plain_tokenizer: Any) -> None:
    parser = ThinkReasoningParser(plain_tokenizer)
    assert len(parser.end_token_ids) == 4
    reasoning, content = _encode(plain_tokenizer, "Let me see."), _encode(plain_tokenizer, "It is 4.")
    ids = _encode(plain_tokenizer, "<think>") + reasoning + _encode(plain_tokenizer, "</think>")
    assert not parser.is_reasoning_end(ids[:-1])  # three of the end tag's four pieces
    assert parser.is_reasoning_end(ids)
    assert parser.extract_content_ids(ids + content) == content


# --------------------------------------------------------- the plugin kind


class _StartTagRequired(ThinkReasoningParser):
    """Broken: a reply whose template opened <think> is taken for all content."""

    def _split(self, text: str, final: bool) -> tuple[str, str | None]:
        if not text.startswith(self.start_tag):
            return "", text
        return super()._split(text, final)


class _LeakyStreaming(ThinkReasoningParser):
    """Broken: streams every delta as reasoning, tags and all."""

    def extract_reasoning_content_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                            *ids: Any) -> DeltaReasoning | None:
        return DeltaReasoning(reasoning_content=delta_text)


class _NoHoldBack(ThinkReasoningParser):
    """Broken: streams text that may still become a tag (fine while tags are one token each)."""

    def _split(self, text: str, final: bool) -> tuple[str, str | None]:
        return super()._split(text, final=True)


class _BracketParser(ThinkReasoningParser):
    """Other tags, same rules: the suite scripts with the parser's own tags."""

    start_tag = "[["
    end_tag = "]]"


class _TestReasoningPlugin:
    @hookimpl
    def register_reasoning_parsers(self, register: Any) -> None:
        register("start_tag_required", _StartTagRequired)
        register("leaky_streaming", _LeakyStreaming)
        register("brackets", _BracketParser)
        register("no_hold_back", _NoHoldBack)


@pytest.fixture
def test_parsers() -> Any:
    pm = get_plugin_manager()
    plugin = _TestReasoningPlugin()
    pm.register(plugin, name="test-reasoning-parsers")
    try:
        yield pm
    finally:
        pm.unregister(plugin)


def test_the_builtin_think_parser_passes_the_conformance_suite() -> None:
    assert get_plugin_manager().reasoning_parsers.get("think").source == "builtin"
    run_suite("reasoning_parser", "think")


def test_a_plugin_parser_with_its_own_tags_passes_the_suite(test_parsers: Any) -> None:
    run_suite("reasoning_parser", "brackets")
    assert test_parsers.reasoning_parsers.load("brackets") is _BracketParser


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("start_tag_required", "split-exact"),
        ("leaky_streaming", "streaming-prefix-of-whole"),
        ("no_hold_back", "tag-split-across-deltas"),
    ],
)
def test_broken_parsers_fail_the_rule_they_break(test_parsers: Any, name: str, rule: str) -> None:
    with pytest.raises(ConformanceError) as failure:
        run_suite("reasoning_parser", name)
    assert failure.value.rule == rule


def test_an_unknown_parser_is_a_config_error_naming_the_registered_ones(tokenizer: Any) -> None:
    with pytest.raises(ConfigError) as failure:
        reasoning_parser_class("deepseek")
    assert failure.value.key == "structured_output.reasoning_parser" and failure.value.value == "deepseek"
    assert "think" in failure.value.allowed
    assert build_reasoning_parser(None, tokenizer) is None
    assert isinstance(build_reasoning_parser("think", tokenizer), ThinkReasoningParser)


def test_reasoning_parser_flag_and_llm_keyword_reach_the_config() -> None:
    from pagedllm.entrypoints.config_flags import flag_names

    assert flag_names()[("structured_output", "reasoning_parser")] == "reasoning_parser"
    assert EngineConfig.from_flat(reasoning_parser="think").structured_output.reasoning_parser == "think"


# ------------------------------------------------- the structured-output gate


def _manager(tokenizer: Any, reasoning_parser: str | None) -> StructuredOutputManager:
    config = StructuredOutputConfig(reasoning_parser=reasoning_parser)
    return StructuredOutputManager(config, vocab_size=len(tokenizer), tokenizer=tokenizer,
                                   eos_token_id=tokenizer.eos_token_id, max_num_rows=8)


def _json_request(tokenizer: Any, prompt: str) -> Request:
    params = SamplingParams(temperature=0.0, structured_outputs=SO(json=json.dumps(SCHEMA)))
    return Request("r", _encode(tokenizer, prompt), params, eos_token_id=tokenizer.eos_token_id)


def _ready(manager: StructuredOutputManager, request: Request) -> Any:
    manager.grammar_init(request)
    so_request = request.structured_output_request
    so_request.future.result(timeout=60)
    assert so_request.is_ready() and so_request.grammar is not None
    return so_request


def test_a_draft_that_ends_reasoning_puts_the_rows_after_it_under_the_grammar(tokenizer: Any) -> None:
    manager = _manager(tokenizer, "think")
    request = _json_request(tokenizer, "Question?\n")
    so_request = _ready(manager, request)
    assert not so_request.reasoning_ended and not manager.is_reasoning_ended(request)
    request.append_output_token_ids(_encode(tokenizer, "<think>Let"))
    drafts = _encode(tokenizer, " me</think>hello")  # " me", "</think>", "hello"
    assert len(drafts) == 3
    bitmask = manager.grammar_bitmask({"r": request}, ["r"], {"r": drafts})
    allowed = unpack_bitmask(bitmask, len(tokenizer))
    fresh = _manager(tokenizer, None)
    other = _json_request(tokenizer, "Question?\n")
    _ready(fresh, other)
    initial = unpack_bitmask(fresh.grammar_bitmask({"r": other}, ["r"], {}), len(tokenizer))[0]
    # Rows 0 and 1 sample inside the reasoning: every token allowed.
    assert allowed[0].all() and allowed[1].all()
    # Row 2 follows "</think>" and row 3 the rejected "hello": the schema's first token.
    assert torch.equal(allowed[2], initial) and torch.equal(allowed[3], initial)
    assert not initial.all() and not initial[_encode(tokenizer, "hello")[0]] and initial[_encode(tokenizer, "{")[0]]
    # Building the rows left the grammar where it was.
    assert not manager.is_reasoning_ended(request)
    manager.close()
    fresh.close()


def test_the_grammar_advances_only_on_tokens_after_the_end_of_reasoning(tokenizer: Any) -> None:
    manager = _manager(tokenizer, "think")
    request = _json_request(tokenizer, "Question?\n")
    so_request = _ready(manager, request)
    reasoning = _encode(tokenizer, "<think>Let me")
    request.append_output_token_ids(reasoning)
    assert list(manager.grammar_token_ids(request, reasoning)) == []
    step = _encode(tokenizer, " see.</think>{\"")  # one step's accepted tokens (drafts) cross the end
    request.append_output_token_ids(step)
    assert list(manager.grammar_token_ids(request, step)) == _encode(tokenizer, "{\"")
    assert so_request.reasoning_ended and manager.is_reasoning_ended(request)
    later = _encode(tokenizer, "answer")
    request.append_output_token_ids(later)
    assert list(manager.grammar_token_ids(request, later)) == later
    manager.close()


def test_a_prompt_that_closed_the_section_starts_under_the_grammar(tokenizer: Any) -> None:
    manager = _manager(tokenizer, "think")
    # A template with thinking off writes the empty section itself (Qwen3's enable_thinking=False).
    request = _json_request(tokenizer, "Question?\n<think></think>")
    assert _ready(manager, request).reasoning_ended
    opened = _json_request(tokenizer, "Question?\n<think>")
    assert not _ready(manager, opened).reasoning_ended
    # Without a parser every request starts under its grammar.
    plain = _manager(tokenizer, None)
    assert _ready(plain, _json_request(tokenizer, "Question?\n<think>")).reasoning_ended
    for each in (manager, plain):
        each.close()


def test_scripted_tokenizer_keeps_the_tags_in_decoded_text(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "<think>a</think>b")
    assert len(ids) == 4 and tokenizer.decode(ids) == "<think>a</think>b"
