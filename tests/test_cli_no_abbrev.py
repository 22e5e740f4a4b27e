"""No flag is ever taken for a longer one that starts the same way
(argparse's prefix matching, `allow_abbrev`, off everywhere)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every constructor of a parser: ArgumentParser(...) and subparsers' add_parser(...).
PARSER_CALL = re.compile(r"(?:ArgumentParser|\.add_parser)\(")


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield from _all_parsers(child)


def test_every_pagedllm_parser_refuses_abbreviations() -> None:
    parsers = dict(_all_parsers(build_parser()))
    # serve, bench serve and plugins list at least: the walk reached the nested parsers.
    assert {"pagedllm serve", "pagedllm bench serve", "pagedllm plugins list"} <= set(parsers)
    assert [prog for prog, parser in parsers.items() if parser.allow_abbrev] == []


def test_chat_template_is_not_taken_for_chat_template_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    serve = dict(_all_parsers(build_parser()))["pagedllm serve"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--chat-template-time", "3"])
    assert "unrecognized arguments: --chat-template-time" in capsys.readouterr().err


def _call_text(source: str, start: int) -> str:
    """The text of the call whose name ends at `start` (up to its closing paren)."""
    depth = 0
    for index in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[index], 0)
        if depth == 0:
            return source[start:index + 1]
    return source[start:]


def test_every_parser_in_the_repository_turns_off_abbreviations() -> None:
    offenders = []
    num_calls = 0
    for path in sorted(REPO_ROOT.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts):
            continue
        source = path.read_text(encoding="utf-8")
        for match in PARSER_CALL.finditer(source):
            if path.name == Path(__file__).name:
                continue  # this file's own pattern
            num_calls += 1
            if "allow_abbrev=False" not in _call_text(source, match.end() - 1):
                line = source.count("\n", 0, match.start()) + 1
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line}")
    assert num_calls > 30  # the walk found the CLI, benchmarks, training and tests
    assert offenders == []
