"""Which specs are presumed costly before anything compiles them, so the
validator lane sends them straight to its costly queue (validator.py).

What makes a compile slow, measured with xgrammar 0.2.9 against an 8k
vocabulary: a bounded repetition in a regex or a JSON-schema `pattern`
(`.{0,1000}` 0.9 s, `.{0,3000}` 11 s, `.{0,6000}` 60 s; it grows about as the
bound squared), and sheer size (a 34 KB alternation compiles in 2.9 s).
`maxLength` / `maxItems` are not (xgrammar counts them natively: 6 ms at
1000). Anything missed here is caught by the clock: a spec still compiling
after `structured_output.cheap_compile_s` is moved to the costly queue and
remembered as costly by its key.
"""

from __future__ import annotations

import re

# A repetition bound ({n}, {m,n}) at least this large.
COSTLY_REPETITION = 500
# A spec (characters) at least this long.
COSTLY_SPEC_CHARS = 16 * 1024
# Bounds of up to 9 digits are read; longer ones are costly by their length
# (and int() of a 5000-digit string would raise).
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_MAX_BOUND_DIGITS = 9


def presumed_costly(spec: str) -> bool:
    """True if `spec` (any kind, as text) has a large repetition bound or is large."""
    if len(spec) >= COSTLY_SPEC_CHARS:
        return True
    for match in _REPETITION.finditer(spec):
        for bound in match.groups():
            if bound and (len(bound) > _MAX_BOUND_DIGITS or int(bound) >= COSTLY_REPETITION):
                return True
    return False
