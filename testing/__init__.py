"""pagedllm.testing: the conformance kit for plugin authors.

One suite per plugin kind (``pagedllm.testing.suites.<kind>``), each a list
of named rules run against a component registered under a name. A broken
rule raises :class:`ConformanceError` naming the rule. In a plugin's tests:

    from pagedllm.testing import conformance_tests

    test_my_backend = conformance_tests("attention_backend", "my_backend")

or ``pytest --pagedllm-conformance attention_backend:my_backend``.
"""

from __future__ import annotations

from pagedllm.testing.helpers import conformance_tests
from pagedllm.testing.suite import (
    ConformanceError,
    Rule,
    RuleSkipped,
    Suite,
    load_suite,
    run_suite,
    suite_kinds,
)

__all__ = [
    "ConformanceError",
    "Rule",
    "RuleSkipped",
    "Suite",
    "conformance_tests",
    "load_suite",
    "run_suite",
    "suite_kinds",
]
