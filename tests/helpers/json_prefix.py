"""Is a text the start of some JSON document? For outputs of unbounded
grammars (free whitespace, any object) cut by max_tokens: they cannot be
parsed, but every character must still be one the JSON grammar allows there.
Written independently of any grammar backend, so it can catch their bugs."""

from __future__ import annotations

WHITESPACE = " \t\n\r"
ESCAPES = '"\\/bfnrtu'
HEX_DIGITS = "0123456789abcdefABCDEF"


class _EndOfText(Exception):
    """The text ended where JSON needs more: a prefix, not an error."""


class _NotJson(Exception):
    pass


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self) -> str:
        if self.pos >= len(self.text):
            raise _EndOfText
        return self.text[self.pos]

    def take(self, allowed: str) -> str:
        char = self.peek()
        if char not in allowed:
            raise _NotJson(f"{char!r} at {self.pos}")
        self.pos += 1
        return char

    def skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1

    def value(self) -> None:
        self.skip_whitespace()
        char = self.peek()
        if char == "{":
            self.container("{", "}", key=True)
        elif char == "[":
            self.container("[", "]", key=False)
        elif char == '"':
            self.string()
        elif char in "-0123456789":
            self.number()
        else:
            for literal in ("true", "false", "null"):
                if literal.startswith(char):
                    for expected in literal:
                        self.take(expected)
                    return
            raise _NotJson(f"{char!r} at {self.pos}")

    def container(self, opener: str, closer: str, *, key: bool) -> None:
        self.take(opener)
        self.skip_whitespace()
        if self.peek() == closer:
            self.pos += 1
            return
        while True:
            if key:
                self.skip_whitespace()
                self.string()
                self.skip_whitespace()
                self.take(":")
            self.value()
            self.skip_whitespace()
            if self.take("," + closer) == closer:
                return

    def string(self) -> None:
        self.take('"')
        while True:
            char = self.peek()
            self.pos += 1
            if char == '"':
                return
            if ord(char) < 0x20:
                raise _NotJson(f"control character at {self.pos - 1}")
            if char == "\\" and self.take(ESCAPES) == "u":
                for _ in range(4):
                    self.take(HEX_DIGITS)

    def number(self) -> None:
        if self.peek() == "-":
            self.pos += 1
        if self.take("0123456789") != "0":
            self.digits()
        if self.pos < len(self.text) and self.text[self.pos] == ".":
            self.pos += 1
            self.take("0123456789")
            self.digits()
        if self.pos < len(self.text) and self.text[self.pos] in "eE":
            self.pos += 1
            if self.peek() in "+-":
                self.pos += 1
            self.take("0123456789")
            self.digits()

    def digits(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in "0123456789":
            self.pos += 1


def is_json_prefix(text: str) -> bool:
    """True when `text` is a whole JSON document or can be extended into one."""
    parser = _Parser(text)
    try:
        parser.value()
        parser.skip_whitespace()
    except _EndOfText:
        return True
    except _NotJson:
        return False
    return parser.pos == len(text)
