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


class RuleSkipped(Exception):
    """A rule that cannot run here (a CUDA-only backend on a CPU machine, a
    required package not installed): not a failure; pytest reports a skip."""

    def __init__(self, rule: str, reason: str) -> None:
        self.rule = rule
        self.reason = reason
        super().__init__(f"conformance rule {rule!r} skipped: {reason}")


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

    def get(self, name: str) -> Rule:
        for rule in self.rules:
            if rule.name == name:
                return rule
        raise ValueError(f"{self.kind} suite has no rule {name!r}; rules: {', '.join(self.rule_names())}")

    def rule_names(self) -> list[str]:
        return [rule.name for rule in self.rules]


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


def run_suite(kind: str, name: str) -> list[RuleSkipped]:
    """Run every rule of ``kind``'s suite against the component ``name``;
    the first broken rule raises its ConformanceError. Returns the rules
    that could not run here."""
    skipped = []
    for rule in load_suite(kind).rules:
        try:
            rule.check(name)
        except RuleSkipped as skip:
            skipped.append(skip)
    return skipped


def suite_kinds() -> list[str]:
    """The plugin kinds the kit has a suite for (the modules of
    ``pagedllm.testing.suites``), without importing any of them."""
    import pkgutil

    package = importlib.import_module(SUITES_PACKAGE)
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))
