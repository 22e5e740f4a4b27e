"""The package's import graph, read from source with `ast` (nothing is imported).

An edge `a -> b` means module `a` names module `b` in an import statement. An
import is *run-time* when it executes: at module level or inside a function;
one under `if TYPE_CHECKING:` is *type-only*. `from pagedllm.x import y` is an
edge to `pagedllm.x.y` when `y` is a submodule, else to `pagedllm.x`. A parent
package's `__init__` that Python runs on the way is not an edge: every module
would otherwise reach the root `__init__` (which re-exports the front ends) and
the graph would be one cycle that says nothing.

Two checks read the graph (docs/architecture.md, "The layers"):
- `layer_violations`: a run-time import that runs up the layer map `LAYERS`
  (lowest first), or from one plugin kind into another kind's implementation
  that `KIND_USES` does not declare. Every module may import a plugin kind's
  *interface* (`<kind>.base`, `<kind>.interface`, `<kind>.types`, and a kind's
  package `__init__` that defines nothing and imports, at run time, interfaces
  and core only). `core_rule_violations` is the same rule for core/ alone;
- `import_cycles`: the strongly connected components of the graph (Tarjan), run-time
  edges only or type-only edges included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "pagedllm"
CORE = f"{PACKAGE}.core"

# ------------------------------------------------------------ the layer map
# Lowest first: a module imports at run time only its own layer or a lower
# one. Names are top-level packages; ROOT is the package's own __init__ (it
# re-exports the front end, `LLM`). KINDS stands for every top-level package
# that no other layer names: the plugin kinds and what they share.
ROOT = ""
KINDS = "<plugin kinds>"
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"core", "plugins"}),
    frozenset({KINDS}),
    frozenset({"worker"}),
    frozenset({"executors"}),
    frozenset({"engine", ROOT}),
    frozenset({"entrypoints"}),
    frozenset({"testing"}),
)
# Among the kinds, a kind imports at run time its own package, any kind's
# interface, the kinds every kind may use, and the kinds it lists below (an
# order among kinds: no kind lists one that lists it, directly or not).
SHARED_KINDS = frozenset({"platforms", "distributed"})
KIND_USES: Mapping[str, frozenset[str]] = {
    # Drafters load and run models: the loader, the layers, the forward batch
    # (model_registry/input_batch.py) and their own KV cache (kv_cache.py).
    "spec_decode": frozenset({"model_registry"}),
    # Grammars are compiled against the model's tokenizer
    # (model_registry/tokenizer.py) and wait for the reasoning parser.
    "structured_output": frozenset({"model_registry", "reasoning"}),
    # Checkpoint formats (GPTQ, AWQ) replace the layers' weights before
    # loading: they read the linear layers' kinds and raise ModelLoadError.
    "quantization": frozenset({"model_registry"}),
    # Adapters attach slots to a loaded model's linear layers (layers/lora.py).
    "lora": frozenset({"model_registry"}),
}
INTERFACE_MODULE_NAMES = frozenset({"base", "interface", "types"})
# Folders of the repository root that are not part of the installed package.
EXCLUDED_DIRS = frozenset({"tests", "examples", "benchmarks", "training", "docs", "build", "dist", "__pycache__"})


@dataclass(frozen=True)
class ModuleSource:
    text: str
    is_package: bool = False  # an `__init__.py` (relative imports resolve inside it)


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    type_only: bool

    def __str__(self) -> str:
        kind = "type-only" if self.type_only else "run-time"
        return f"{self.importer}:{self.line} imports {self.target} ({kind})"


@dataclass
class ImportGraph:
    modules: frozenset[str]
    imports: list[Import] = field(default_factory=list)
    # Modules that define nothing (no def, no class): a package __init__ of
    # these may stand for the interfaces it re-exports.
    reexport_only: set[str] = field(default_factory=set)

    def edges(self, *, include_type_only: bool) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = {name: set() for name in self.modules}
        for imp in self.imports:
            if (include_type_only or not imp.type_only) and imp.target != imp.importer:
                graph[imp.importer].add(imp.target)
        return graph


def package_sources(root: Path) -> dict[str, ModuleSource]:
    """Every module of the package whose `__init__.py` is `root/__init__.py`."""
    sources: dict[str, ModuleSource] = {}
    for path in _package_files(root):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        sources[".".join([PACKAGE, *parts])] = ModuleSource(path.read_text(encoding="utf-8"), is_package)
    return sources


def _package_files(folder: Path) -> Iterator[Path]:
    # Only folders with an __init__.py are subpackages (weights, templates are not).
    yield from sorted(folder.glob("*.py"))
    for child in sorted(folder.iterdir()):
        if (
            child.is_dir()
            and child.name not in EXCLUDED_DIRS
            and not child.name.startswith(".")
            and not child.name.endswith(".egg-info")
            and (child / "__init__.py").is_file()
        ):
            yield from _package_files(child)


def build_graph(sources: Mapping[str, ModuleSource]) -> ImportGraph:
    graph = ImportGraph(frozenset(sources))
    for name, source in sources.items():
        tree = ast.parse(source.text, filename=name)
        if not any(isinstance(node, _DEFINITIONS) for node in tree.body):
            graph.reexport_only.add(name)
        visitor = _ImportVisitor(name, source.is_package, graph.modules)
        visitor.visit(tree)
        graph.imports.extend(visitor.imports)
    return graph


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: frozenset[str]) -> None:
        self.module = module
        # The package relative imports start from.
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.type_only = False
        self.imports: list[Import] = []

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.type_only = self.type_only, True
        for child in node.body:
            self.visit(child)
        self.type_only = outer
        for child in node.orelse:  # `else:` of TYPE_CHECKING runs
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        if base is None:
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.known else base, node.lineno)

    def _absolute(self, module: str | None, level: int) -> str | None:
        if level == 0:
            return module
        parts = self.package.split(".")
        if level > 1:
            parts = parts[: -(level - 1)]
        return ".".join([*parts, module] if module else parts)

    def _add(self, target: str, line: int) -> None:
        imp = Import(self.module, target, line, self.type_only)
        # `from x import a, b` names module x once.
        if target in self.known and (not self.imports or self.imports[-1] != imp):
            self.imports.append(imp)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


# ---------------------------------------------------------------- the layers


def top_package(module: str) -> str | None:
    """`pagedllm.spec_decode.ngram` -> "spec_decode"; None for the root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_index(module: str) -> int:
    """The position of `module`'s layer in LAYERS."""
    pkg = top_package(module)
    name = ROOT if pkg is None else pkg
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    return KINDS_LAYER


KINDS_LAYER = next(index for index, names in enumerate(LAYERS) if KINDS in names)


def is_kind(module: str) -> bool:
    return top_package(module) is not None and layer_index(module) == KINDS_LAYER


def is_interface(target: str, graph: ImportGraph, seen: frozenset[str] = frozenset()) -> bool:
    """A plugin kind's interface module, or its package __init__ that stands
    for interfaces (defines nothing, imports at run time only interfaces and
    the bottom layer)."""
    if not is_kind(target) or target in seen:  # seen: an __init__ reached again through its own imports
        return False
    parts = target.split(".")
    if len(parts) == 3:
        return parts[2] in INTERFACE_MODULE_NAMES
    return len(parts) == 2 and target in graph.reexport_only and all(
        layer_index(imp.target) == 0 or is_interface(imp.target, graph, seen | {target})
        for imp in graph.imports
        if imp.importer == target and not imp.type_only
    )


def _allowed(imp: Import, graph: ImportGraph) -> bool:
    importer_pkg, target_pkg = top_package(imp.importer), top_package(imp.target)
    if imp.type_only or importer_pkg == target_pkg or is_interface(imp.target, graph):
        return True
    importer_layer, target_layer = layer_index(imp.importer), layer_index(imp.target)
    if target_layer != importer_layer:
        return target_layer < importer_layer
    if importer_layer != KINDS_LAYER:
        return True  # one layer of several packages (core and plugins; engine and the root)
    return target_pkg in SHARED_KINDS or target_pkg in KIND_USES.get(importer_pkg or ROOT, frozenset())


def layer_violations(graph: ImportGraph) -> list[Import]:
    """Run-time imports up the layer map, or into another kind's
    implementation that KIND_USES does not declare."""
    return [imp for imp in graph.imports if not _allowed(imp, graph)]


def core_rule_violations(graph: ImportGraph) -> list[Import]:
    """Run-time imports by a core module of anything but core, plugins and interfaces."""
    return [imp for imp in layer_violations(graph) if imp.importer == CORE or imp.importer.startswith(f"{CORE}.")]


# ---------------------------------------------------------------------- cycles


@dataclass(frozen=True)
class ImportCycle:
    """A strongly connected component of the graph and one cycle through it."""

    modules: tuple[str, ...]  # every module of the component, sorted
    path: tuple[str, ...]  # the shortest cycle from its first module back to it

    def __str__(self) -> str:
        return f"{' -> '.join(self.path)}  (component: {', '.join(self.modules)})"


def import_cycles(graph: ImportGraph, *, include_type_only: bool) -> list[ImportCycle]:
    """Every strongly connected component of more than one module."""
    edges = graph.edges(include_type_only=include_type_only)
    return [
        ImportCycle(tuple(component), tuple(_cycle_in(component, edges)))
        for component in _strongly_connected(edges)
        if len(component) > 1
    ]


def _strongly_connected(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            child = next(successors, None)
            if child is None:
                work.pop()
                if work:
                    lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
                if lowlink[node] == index[node]:
                    components.append(_pop_component(node, stack, on_stack))
            elif child not in index:
                index[child] = lowlink[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                lowlink[node] = min(lowlink[node], index[child])
    return components


def _pop_component(node: str, stack: list[str], on_stack: set[str]) -> list[str]:
    component: list[str] = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
            return sorted(component)


def _cycle_in(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """The shortest path from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier: list[str] = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parents:
                    parents[child] = node
                    next_frontier.append(child)
        frontier = next_frontier
    raise AssertionError(f"no cycle in strongly connected component {component}")
