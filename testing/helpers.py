"""``conformance_tests``: a kind's suite as one parametrized test in a
plugin's own test file.

    from pagedllm.testing import conformance_tests

    test_my_backend = conformance_tests("attention_backend", "my_backend")
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.testing.suite import load_suite


def conformance_tests(kind: str, name: str) -> Callable[[str], None]:
    """A pytest test function, parametrized over every rule of ``kind``'s
    suite, that runs the rule against the component registered as ``name``.
    Assign it to a ``test_*`` name in a test module."""
    import pytest

    from pagedllm.testing.pytest_plugin import run_rule

    @pytest.mark.parametrize("rule", load_suite(kind).rule_names())
    def test_conformance(rule: str) -> None:
        run_rule(kind, name, rule)

    test_conformance.__doc__ = f"{kind} {name!r} keeps every rule of the pagedllm conformance suite."
    return test_conformance
