"""The import rule (docs/architecture.md): core/ imports, at run time, only
core/, plugins/ and the plugin packages' interface modules; no module takes
part in an import cycle, run-time or type-only.

The checker is tests/helpers/import_graph.py; the synthetic cases below show
it failing on a deliberate violation, so a green run means something.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.import_graph import (
    Import,
    ImportCycle,
    ModuleSource,
    build_graph,
    core_rule_violations,
    import_cycles,
    package_sources,
)

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def package_graph():
    return build_graph(package_sources(PACKAGE_ROOT))


def test_the_graph_covers_the_package(package_graph) -> None:
    # A checker that reads no module passes every rule: make sure it read them.
    modules = package_graph.modules
    for name in ("pagedllm", "pagedllm.core.engine", "pagedllm.core.kv_cache.manager", "pagedllm.engine.builder"):
        assert name in modules
    assert not any(name.startswith(("pagedllm.tests", "pagedllm.examples", "pagedllm.benchmarks")) for name in modules)
    importers = {imp.importer for imp in package_graph.imports if imp.target == "pagedllm.core.request"}
    assert "pagedllm.core.scheduler" in importers


def test_core_imports_no_implementation(package_graph) -> None:
    violations = core_rule_violations(package_graph)
    assert violations == [], "core imports at run time more than core, plugins and interfaces:\n" + "\n".join(
        map(str, violations)
    )


def test_no_run_time_import_cycle(package_graph) -> None:
    cycles = import_cycles(package_graph, include_type_only=False)
    assert cycles == [], "run-time import cycles:\n" + "\n".join(map(str, cycles))


def test_no_type_only_import_cycle(package_graph) -> None:
    cycles = import_cycles(package_graph, include_type_only=True)
    assert cycles == [], "import cycles (type-only imports included):\n" + "\n".join(map(str, cycles))


# ------------------------------------------------------- the checker itself

_CORE_ENGINE = """\
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.request import Request
from pagedllm.model_registry.base import ModelBase
from pagedllm.spec_decode import Drafter
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from pagedllm.engine.llm import LLM


def build():
    from pagedllm.model_registry.tiny import resolve_model_path
    return resolve_model_path
"""


def _synthetic_package(spec_decode_init: str) -> dict[str, ModuleSource]:
    empty = ModuleSource("", is_package=True)
    return {
        "pagedllm": empty,
        "pagedllm.core": empty,
        "pagedllm.core.engine": ModuleSource(_CORE_ENGINE),
        "pagedllm.core.request": ModuleSource(""),
        "pagedllm.plugins": empty,
        "pagedllm.model_registry": empty,
        "pagedllm.model_registry.base": ModuleSource(""),
        "pagedllm.model_registry.tiny": empty,
        "pagedllm.spec_decode": ModuleSource(spec_decode_init, is_package=True),
        "pagedllm.spec_decode.interface": ModuleSource(""),
        "pagedllm.spec_decode.ngram": ModuleSource(""),
        "pagedllm.engine": empty,
        "pagedllm.engine.llm": ModuleSource(""),
    }


def test_checker_reports_a_core_module_importing_an_implementation() -> None:
    # Interface modules, a re-export-only package __init__ and a type-only
    # import of the engine are allowed; the function-level import of the
    # tiny model package is the one violation.
    graph = build_graph(_synthetic_package("from pagedllm.spec_decode.interface import Drafter\n"))
    assert core_rule_violations(graph) == [
        Import("pagedllm.core.engine", "pagedllm.model_registry.tiny", 15, type_only=False)
    ]


@pytest.mark.parametrize(
    "spec_decode_init",
    [
        # A package __init__ that imports an implementation is one itself...
        "from pagedllm.spec_decode.ngram import NgramDrafter\n",
        # ...and so is one that defines code.
        "from pagedllm.spec_decode.interface import Drafter\n\ndef load():\n    pass\n",
    ],
)
def test_checker_treats_a_package_init_with_code_as_an_implementation(spec_decode_init: str) -> None:
    graph = build_graph(_synthetic_package(spec_decode_init))
    assert [(imp.target, imp.line) for imp in core_rule_violations(graph)] == [
        ("pagedllm.spec_decode", 7),
        ("pagedllm.model_registry.tiny", 15),
    ]


def test_checker_reports_cycles_and_tells_type_only_ones_apart() -> None:
    sources = {
        "pagedllm": ModuleSource("", is_package=True),
        "pagedllm.core": ModuleSource("", is_package=True),
        # a -> b at function level, b -> a at module level (relative import).
        "pagedllm.core.a": ModuleSource("def f():\n    from pagedllm.core import b\n"),
        "pagedllm.core.b": ModuleSource("from . import a\n"),
        # c -> d at run time, d -> c only for type checking.
        "pagedllm.core.c": ModuleSource("import pagedllm.core.d\n"),
        "pagedllm.core.d": ModuleSource(
            "import typing\nif typing.TYPE_CHECKING:\n    from pagedllm.core.c import X\nelse:\n    X = None\n"
        ),
    }
    graph = build_graph(sources)
    a_b = ImportCycle(("pagedllm.core.a", "pagedllm.core.b"), ("pagedllm.core.a", "pagedllm.core.b", "pagedllm.core.a"))
    c_d = ImportCycle(("pagedllm.core.c", "pagedllm.core.d"), ("pagedllm.core.c", "pagedllm.core.d", "pagedllm.core.c"))
    assert import_cycles(graph, include_type_only=False) == [a_b]
    assert sorted(import_cycles(graph, include_type_only=True), key=str) == [a_b, c_d]


def test_checker_reports_every_module_of_a_larger_cycle() -> None:
    # x -> y -> z -> x and y -> x: one component, the shortest cycle from x.
    sources = {
        "pagedllm.x": ModuleSource("import pagedllm.y\n"),
        "pagedllm.y": ModuleSource("import pagedllm.z\nimport pagedllm.x\n"),
        "pagedllm.z": ModuleSource("from pagedllm import x\n"),
    }
    sources["pagedllm"] = ModuleSource("", is_package=True)
    assert import_cycles(build_graph(sources), include_type_only=False) == [
        ImportCycle(("pagedllm.x", "pagedllm.y", "pagedllm.z"), ("pagedllm.x", "pagedllm.y", "pagedllm.x"))
    ]


def test_package_sources_reads_files_and_skips_non_package_folders(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "engine.py").write_text("from pagedllm.core import scheduler\n")
    (tmp_path / "core" / "scheduler.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / "weights").mkdir()  # no __init__.py: data, not a package
    (tmp_path / "weights" / "convert.py").write_text("")
    sources = package_sources(tmp_path)
    assert sorted(sources) == ["pagedllm", "pagedllm.core", "pagedllm.core.engine", "pagedllm.core.scheduler"]
    assert sources["pagedllm.core"].is_package and not sources["pagedllm.core.engine"].is_package
    assert build_graph(sources).imports == [
        Import("pagedllm.core.engine", "pagedllm.core.scheduler", 1, type_only=False)
    ]
