"""The conformance kit as a pytest plugin (entry point group ``pytest11``).

Installed with pagedllm, it gives every pytest run:

- ``pytest --pagedllm-conformance KIND:NAME`` (repeatable): one test item per
  rule of KIND's suite, run against the component registered as NAME, and
  nothing else collected;
- the ``pagedllm_conformance`` fixture: ``pagedllm_conformance(kind, name)``
  runs a whole suite inside one test.

A plugin's own test file uses :func:`pagedllm.testing.conformance_tests`.

NOTE: pytest loads this module in every run of every project installed next
to pagedllm: it imports neither torch nor any suite until one is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pagedllm.testing.suite import ConformanceError, RuleSkipped, load_suite, run_suite

OPTION = "--pagedllm-conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedllm", "pagedllm conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="KIND:NAME",
        help="run the conformance suite of plugin kind KIND against the component registered as NAME "
        "(e.g. attention_backend:sdpa; NAME * = every registered one); repeatable; only these checks are collected",
    )


def parse_target(spec: str) -> tuple[str, str]:
    """``"attention_backend:sdpa"`` -> ("attention_backend", "sdpa")."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise pytest.UsageError(f"{OPTION} {spec!r}: expected KIND:NAME, e.g. attention_backend:sdpa")
    return kind, name


def run_rule(kind: str, name: str, rule: str) -> None:
    """Run one rule; a rule that cannot run here is a pytest skip."""
    check = load_suite(kind).get(rule).check
    try:
        check(name)
    except RuleSkipped as skipped:
        pytest.skip(skipped.reason)


class ConformanceItem(pytest.Item):
    def __init__(self, *, kind: str, component: str, rule: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind, self.component, self.rule = kind, component, rule

    def runtest(self) -> None:
        run_rule(self.kind, self.component, self.rule)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, ConformanceError):
            return f"{self.kind} {self.component!r}: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "pagedllm-conformance", None, f"{self.kind}:{self.component} [{self.rule}]"


class ConformanceCollector(pytest.Collector):
    def __init__(self, *, targets: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.targets = targets

    def collect(self) -> Iterator[ConformanceItem]:
        for kind, component in self.targets:
            try:
                suite = load_suite(kind)
            except ValueError as exc:
                raise pytest.UsageError(f"{OPTION} {kind}:{component}: {exc}") from None
            for name in _registered_names(kind) if component == "*" else [component]:
                for rule in suite.rule_names():
                    yield ConformanceItem.from_parent(
                        self, name=f"{kind}:{name}[{rule}]", kind=kind, component=name, rule=rule
                    )


def _registered_names(kind: str) -> list[str]:
    from pagedllm.plugins import get_plugin_manager

    return get_plugin_manager().registry(kind).names()


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> bool | None:
    specs: list[str] = session.config.getoption("pagedllm_conformance")
    if not specs:
        return None
    targets = [parse_target(spec) for spec in specs]
    collector = ConformanceCollector.from_parent(
        session, name="pagedllm-conformance", nodeid="pagedllm-conformance", targets=targets
    )
    items: list[pytest.Item] = list(collector.collect())
    hook = session.config.hook
    for item in items:
        hook.pytest_itemcollected(item=item)
    # what the terminal counts ("N tests collected")
    hook.pytest_collectreport(report=pytest.CollectReport(collector.nodeid, "passed", None, [*items]))
    hook.pytest_collection_modifyitems(session=session, config=session.config, items=items)
    session.items = items
    session.testscollected = len(items)
    hook.pytest_collection_finish(session=session)
    return True


@pytest.fixture
def pagedllm_conformance() -> Callable[[str, str], None]:
    """``pagedllm_conformance(kind, name)``: every rule of the kind's suite
    against ``name`` in this one test (rules that cannot run here are skipped;
    all of them skipped is a skip)."""

    def run(kind: str, name: str) -> None:
        skipped = run_suite(kind, name)
        if skipped and len(skipped) == len(load_suite(kind).rules):
            pytest.skip("; ".join(skip.reason for skip in skipped))

    return run
