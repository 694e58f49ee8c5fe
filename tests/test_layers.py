"""The import graph reads as the data flow: no module imports one that imports it back, and no
layer imports one above it (docs/ARCHITECTURE.md draws the layers). Imports inside functions and
under TYPE_CHECKING count: deferring an import hides a circle, it does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Top to bottom: a module may import its own layer's modules and the layers below it.
LAYERS = (
    ("exporter.__main__", "exporter.command"),
    ("exporter.job",),
    # The store registers every backend's schema, so it stands above the backends.
    ("exporter.tracking", "exporter.config.store"),
    ("exporter.cache",),
    (
        "exporter.models",
        "exporter.quantize",
        "exporter.export",
        "exporter.backends",
        "exporter.validate",
        "exporter.localize",
        "exporter.audit",
        "exporter.benchmark",
    ),
    ("exporter.config",),
    ("exporter.process", "exporter.errors", "exporter.files", "exporter"),
    ("runtimes",),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(path): path
    for package in ("exporter", "runtimes")
    for path in sorted((PROJECT_ROOT / package).rglob("*.py"))
}


def imported_by(name: str) -> set[str]:
    """The project's modules that `name` imports, anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imported_by(name) for name in MODULES}


def layer_of(name: str) -> int:
    """The layer of the longest prefix that names the module."""
    best, index = "", len(LAYERS)
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    return index


def test_every_module_has_a_layer() -> None:
    assert [name for name in MODULES if layer_of(name) == len(LAYERS)] == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) < layer_of(name)
    ]
    assert upward == []


def circles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in GRAPH[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in GRAPH:
        if name not in index:
            visit(name)
    return found


def test_the_import_graph_has_no_circle() -> None:
    assert circles() == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]), ({"a": {"b"}, "b": set()}, [])],
)
def test_a_circle_is_found(
    graph: dict[str, set[str]], expected: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(f"{__name__}.GRAPH", graph)
    assert circles() == expected
