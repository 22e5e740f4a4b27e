"""Settings shared by the Hypothesis state-machine tests.

A run is `max_examples` random programs of up to `stateful_step_count` steps.
`PAGEDLLM_STATEFUL_SCALE=N` multiplies the number of programs (e.g. 20 for a
long hunt). A failure prints the shrunk program and a `@reproduce_failure(...)`
line (print_blob): put that decorator on the state-machine class to replay it,
or rerun with `pytest --hypothesis-seed=<seed>`. No example database is kept,
so a run never depends on an earlier one.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE_ENV_VAR = "PAGEDLLM_STATEFUL_SCALE"


def stateful_settings(max_examples: int, stateful_step_count: int, **overrides: object) -> settings:
    scale = float(os.environ.get(SCALE_ENV_VAR, "1"))
    options: dict[str, object] = {
        "max_examples": max(1, round(max_examples * scale)),
        "stateful_step_count": stateful_step_count,
        "deadline": None,
        "database": None,
        "print_blob": True,
        # Every program builds its own small pool; slow draws are not a bug.
        "suppress_health_check": [HealthCheck.too_slow],
    }
    options.update(overrides)
    return settings(**options)  # type: ignore[arg-type]


# Prompts of the state machines: shared prefixes and a two-token tail
# alphabet, so hits, shared blocks and same-tokens-different-salt clashes are
# all common.
PREFIXES = ((), (7, 7, 7, 7), (7, 8, 7, 8, 7, 8), (9,) * 8)
TAIL_TOKENS = (1, 2)
SALTS = (None, "a", "b")
