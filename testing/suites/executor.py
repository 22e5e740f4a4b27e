"""The executor suite: the interface contract. (Whether an executor runs a
model like the in-process one is for engine tests: starting ranks costs
seconds to minutes, too much for a suite every package runs.)"""

from __future__ import annotations

import importlib.util

from pagedllm.testing.components import load, registration
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "executor"
SUITE = Suite(KIND)


def _require_packages(rule: str, name: str) -> None:
    """Skip ``rule`` when a package the executor requires is not installed."""
    missing = [p for p in registration(rule, KIND, name).info.requires if importlib.util.find_spec(p) is None]
    if missing:
        raise RuleSkipped(rule, f"executor {name!r} requires {', '.join(missing)}, not installed")


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports (its required packages installed) and subclasses Executor."""
    rule = "loads"
    _require_packages(rule, name)
    load(rule, KIND, name)


@SUITE.rule("rpc-methods")
def check_rpc_methods(name: str) -> None:
    """RPC_METHODS (what collective_rpc may call on the workers) is a frozenset of names."""
    rule = "rpc-methods"
    _require_packages(rule, name)
    methods = load(rule, KIND, name).RPC_METHODS
    if not isinstance(methods, frozenset) or not all(isinstance(m, str) and m for m in methods):
        raise ConformanceError(rule, f"RPC_METHODS is {methods!r}, not a frozenset of method names")
