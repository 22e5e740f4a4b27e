"""Hot paths read as short phases (issue 14): no function or method in the
minimal core (core/) or the worker layer (worker/) is longer than 60 lines,
decorators and docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
LAYERS = ("core", "worker")


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(qualified name, length) of every function in `source` longer than `max_lines`."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                length = (child.end_lineno or child.lineno) - first + 1
                if length > max_lines:
                    found.append((prefix + child.name, length))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return found


def test_the_check_finds_a_long_method_and_a_long_nested_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    source = f"class Scheduler:\n    @staticmethod\n    def schedule():\n{body}\n\ndef short():\n    return 1\n"
    assert long_functions(source) == [("Scheduler.schedule", 62)]
    inner_body = "\n".join(f"        y{i} = {i}" for i in range(60))
    nested = f"def outer():\n    def inner():\n{inner_body}\n    return inner\n"
    assert long_functions(nested) == [("outer", 63), ("outer.inner", 61)]


@pytest.mark.parametrize("layer", LAYERS)
def test_no_function_in_the_layer_is_over_60_lines(layer: str) -> None:
    paths = sorted((PACKAGE_ROOT / layer).rglob("*.py"))
    assert paths, f"no modules found under {layer}/"
    too_long = {
        f"{path.relative_to(PACKAGE_ROOT)}:{name}": length
        for path in paths
        for name, length in long_functions(path.read_text())
    }
    assert too_long == {}
