"""The contract every conformance suite follows.

A suite module ``pagedllm.testing.suites.<kind>`` (``<kind>`` is a
:class:`pagedllm.plugins.kinds.PluginKind` value) defines ``SUITE = Suite(kind)``
and registers its rules with ``@SUITE.rule("rule-name")``. A rule is a
function ``check(name: str) -> None`` that receives the registered name of the
component under test, looks it up through the plugin manager, exercises it,
and raises :class:`ConformanceError` (with its own rule name) when the
component breaks the rule.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

SUITES_PACKAGE = "pagedllm.testing.suites"

CheckFn = Callable[[str], None]


class ConformanceError(AssertionError):
    """A component broke a conformance rule; ``rule`` names which."""

    def __init__(self, rule: str, message: str) -> None:
        self.rule = rule
        super().__init__(f"conformance rule {rule!r} broken: {message}")


@dataclass(frozen=True)
class Rule:
    name: str
    check: CheckFn
    doc: str = ""


@dataclass
class Suite:
    """The rules of one plugin kind, in the order they run."""

    kind: str
    rules: list[Rule] = field(default_factory=list)

    def rule(self, name: str) -> Callable[[CheckFn], CheckFn]:
        def decorate(check: CheckFn) -> CheckFn:
            if any(existing.name == name for existing in self.rules):
                raise ValueError(f"{self.kind} suite: rule {name!r} defined twice")
            self.rules.append(Rule(name, check, (check.__doc__ or "").strip()))
            return check

        return decorate


def load_suite(kind: str) -> Suite:
    """The suite of ``kind``; ValueError when the kit has none for it."""
    try:
        module = importlib.import_module(f"{SUITES_PACKAGE}.{kind}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{SUITES_PACKAGE}.{kind}":
            raise
        raise ValueError(f"no conformance suite for plugin kind {kind!r}") from None
    suite: Suite = module.SUITE
    return suite


def run_suite(kind: str, name: str) -> None:
    """Run every rule of ``kind``'s suite against the component ``name``;
    the first broken rule raises its ConformanceError."""
    for rule in load_suite(kind).rules:
        rule.check(name)
