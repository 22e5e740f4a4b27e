"""pagedllm.testing: the conformance kit for plugin authors.

One suite per plugin kind (``pagedllm.testing.suites.<kind>``), each a list
of named rules run against a component registered under a name. A broken
rule raises :class:`ConformanceError` naming the rule.
"""

from __future__ import annotations

from pagedllm.testing.suite import ConformanceError, Rule, Suite, load_suite, run_suite

__all__ = ["ConformanceError", "Rule", "Suite", "load_suite", "run_suite"]
