"""Integer ranges that every validator enforces, and values short enough to echo.

Python's `int` is unbounded and a JSON parser accepts any number of digits,
but everything behind validation is not: msgpack (the engine-core wire)
holds [-2**63, 2**64), tensors and generator seeds hold int64. So every
integer a client sends is checked against a range here, before any encoder,
tensor or tokenizer sees it, and an error echoes the value shortened (a
5,000-digit int would not even `repr()`: Python refuses int -> str past
4,300 digits).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from pagedllm.core.errors import InvalidRequestError

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# The widest unsigned integer msgspec (the engine wire format) encodes.
UINT64_MAX = (1 << 64) - 1
# Longest echo of a client value in an error message.
MAX_ECHO_CHARS = 80
# Below this many bits an int's decimal text is short enough to build
# (and far below Python's 4,300-digit limit).
_MAX_DECIMAL_BITS = 1024


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (True is an int to Python, not to a client)."""
    return isinstance(value, int) and not isinstance(value, bool)


def short_value(value: Any, limit: int = MAX_ECHO_CHARS) -> Any:
    """`value` itself when its repr is short, else a shortened text of it."""
    if is_int(value) and value.bit_length() > _MAX_DECIMAL_BITS:
        # ~0.30103 decimal digits per bit; no decimal conversion of the whole number.
        sign = "-" if value < 0 else ""
        return f"<{sign}integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:  # a container holding a huge int
        return f"<{type(value).__name__} too large to show>"
    return value if len(text) <= limit else text[: limit - 3] + "..."


def check_int(field: str, value: Any, low: int, high: int, limit: str | None = None) -> int:
    """`value` if it is an int in [low, high], else InvalidRequestError naming
    `field` (`limit` says the rule when "an integer in [low, high]" would not)."""
    if not is_int(value) or not low <= value <= high:
        raise InvalidRequestError(field, short_value(value), limit or f"must be an integer in [{low}, {high}]")
    return value


def check_priority(priority: Any) -> int:
    """A request's scheduling priority: any int64 (lower runs first)."""
    return check_int("priority", priority, INT64_MIN, INT64_MAX)
