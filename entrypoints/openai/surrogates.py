"""Unpaired UTF-16 surrogates in request strings.

JSON allows `"\\ud800"` and Python's json module turns it into a `str` holding
a lone surrogate, which no UTF-8 encoder, tokenizer or grammar compiler
accepts. Every string of a request body (dict keys and nested values too) is
checked here when it is validated, so the client gets a 400 naming the field
instead of a 500 from whatever touches the text first.
"""

from __future__ import annotations

from typing import Any


def surrogate_position(text: str) -> int | None:
    """Index of the first lone surrogate in `text`, None when it is valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def find_unpaired_surrogate(value: Any) -> tuple[str, int] | None:
    """(JSON-pointer-like path inside `value`, character index) of the first
    string or dict key holding a lone surrogate; None when there is none.

    Iterative, so a deeply nested value cannot exhaust the stack; lists of
    numbers (token-id prompts) cost one type check per item.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            position = surrogate_position(item)
            if position is not None:
                return path, position
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str):
                    position = surrogate_position(key)
                    if position is not None:
                        return f"{path}/{_escape(key)}", position
                if isinstance(sub, (str, dict, list)):
                    stack.append((f"{path}/{_escape(str(key))}", sub))
        elif isinstance(item, list):
            for index, sub in enumerate(item):
                if isinstance(sub, (str, dict, list)):
                    stack.append((f"{path}/{index}", sub))
    return None


def _escape(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("utf-8")
