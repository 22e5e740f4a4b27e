"""Reading the output that `tool_choice="required"` forces,
`[{"name": "f", "parameters": {...}}, ...]`, while it is generated: a call's
name as soon as its string closes, then its `parameters` value as raw text
fragments (the call's `arguments`). Whole responses read the same way, so
streamed and whole calls are equal, a cut (max_tokens) output included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# NOTE: JSON nesting of the forced shape: 1 = the array, 2 = a call object.
CALL_DEPTH = 2


@dataclass
class ForcedCall:
    name: str | None = None
    arguments: str = ""
    num_arguments_sent: int = 0


@dataclass
class ForcedCallsReader:
    """Feed the text as it comes; `take_pieces` returns (index, name,
    arguments) pieces not yet sent: a call's name first, then its arguments."""

    calls: list[ForcedCall] = field(default_factory=list)
    num_names_sent: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _call_string: list[str] | None = None  # a key or the name, read at CALL_DEPTH
    _key: str | None = None  # the key whose value is being read, at CALL_DEPTH
    _in_parameters: bool = False

    def feed(self, text: str) -> None:
        for char in text:
            if self._in_parameters:
                self._parameters_char(char)
            else:
                self._structure_char(char)

    def _structure_char(self, char: str) -> None:
        if self._call_string is not None:  # inside a key or the name, at CALL_DEPTH
            self._call_string.append(char)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._end_call_string(json.loads('"' + "".join(self._call_string)))
            return
        if char in "[{":
            self._depth += 1
            if char == "{" and self._depth == CALL_DEPTH:
                self.calls.append(ForcedCall())
                self._key = None
        elif char in "]}":
            self._depth -= 1
        elif char == '"' and self._depth == CALL_DEPTH:
            self._call_string = []
        elif char == ":" and self._depth == CALL_DEPTH and self._key == "parameters":
            self._in_parameters = True  # the value starts after the colon (leading whitespace skipped)

    def _end_call_string(self, value: str) -> None:
        self._call_string = None
        if self._key == "name" and self.calls and self.calls[-1].name is None:
            self.calls[-1].name = value
            self._key = None
        else:
            self._key = value

    def _parameters_char(self, char: str) -> None:
        call = self.calls[-1]
        value_depth = self._depth - CALL_DEPTH
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif value_depth == 0 and (char in ",}" or (char.isspace() and call.arguments)):
            self._in_parameters = False  # the value ended (after a scalar; an object ends at its brace)
            self._key = None
            self._structure_char(char)
            return
        elif char.isspace() and not call.arguments:
            return
        elif char in "[{":
            self._depth += 1
        elif char in "]}":
            self._depth -= 1
            if self._depth == CALL_DEPTH:  # an object or array value just closed
                self._in_parameters = False
                self._key = None
        elif char == '"':
            self._in_string = True
        call.arguments += char

    def take_pieces(self) -> list[tuple[int, str | None, str | None]]:
        pieces: list[tuple[int, str | None, str | None]] = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                break
            if index >= self.num_names_sent:
                pieces.append((index, call.name, ""))
                self.num_names_sent = index + 1
            if len(call.arguments) > call.num_arguments_sent:
                pieces.append((index, None, call.arguments[call.num_arguments_sent:]))
                call.num_arguments_sent = len(call.arguments)
        return pieces


def read_forced_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of every call started in a whole `required` output."""
    reader = ForcedCallsReader()
    reader.feed(text)
    return [(call.name, call.arguments) for call in reader.calls if call.name is not None]
