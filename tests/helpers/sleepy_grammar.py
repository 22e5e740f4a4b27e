"""A grammar backend whose `validate` takes as long as its spec says, for
the validator lane's tests: a regex "sleep <seconds> <anything>" validates in
that many seconds (the lane's children import it by module path, so the
tests put tests/ on the children's PYTHONPATH). It never compiles: the tests
give the lane no vocabulary."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.structured_output.interface import GrammarBackend, StructuredOutputKind


class SleepyBackend(GrammarBackend):
    name = "sleepy"

    @classmethod
    def validate(cls, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True) -> None:
        words = spec.split()
        if len(words) >= 2 and words[0] == "sleep":
            time.sleep(float(words[1]))

    def compile(self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True) -> Any:
        raise NotImplementedError("the sleepy backend only validates")
