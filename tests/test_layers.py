"""The import graph reads as the data flow: no module imports one that imports it back, and no
layer imports one above it (docs/ARCHITECTURE.md draws the layers). Imports inside functions and
under TYPE_CHECKING count: deferring an import hides a circle, it does not remove it.

The stages stand one above another in the order a job runs them (docs/ARCHITECTURE.md's table of
one job: model, quantize, export, goldens, lower, validate, localize and repair, benchmark), each
package where the job first runs it. A stage takes what an earlier one hands it, so it may import
an earlier stage, to name the value or use its helpers; it never imports a later one. What the
lower stage hands on (the artifact and its partition), which every later stage and the job's
record take, stands below every stage.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Top to bottom: a module may import its own layer's modules and the layers below it.
LAYERS = (
    ("exporter.__main__", "exporter.command"),
    ("exporter.job",),
    ("exporter.tracking",),
    ("exporter.cache",),
    # The stages, the last a job runs first.
    ("exporter.benchmark",),
    # Localization, and the repair it proposes (the job lowers again with it).
    ("exporter.localize",),
    # The weights audit of the validate stage, which reads the lowered artifact.
    ("exporter.audit",),
    # The lower stage: the registry of backends and each backend.
    ("exporter.backends",),
    # The goldens, made before lowering; the validation after it judges the artifact through the
    # runtime the job loads (runtimes/), never through the lowering's code.
    ("exporter.validate",),
    ("exporter.export",),
    ("exporter.quantize",),
    ("exporter.models",),
    # What the lower stage hands on, which the stages after it and the job's record take.
    ("exporter.artifact",),
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


def imports_in(source: str) -> set[str]:
    """The project's modules that `source` imports, anywhere in it: at the top, inside functions
    and under TYPE_CHECKING alike."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {module for module in found if module in MODULES}


GRAPH = {name: imports_in(path.read_text()) - {name} for name, path in MODULES.items()}


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


def test_every_layer_names_modules_that_are_there() -> None:
    # A name left behind by a move would draw nothing, and the layers would say less than they
    # seem to.
    assert [prefix for layer in LAYERS for prefix in layer if prefix not in MODULES] == []


@pytest.mark.parametrize(
    "source",
    [
        "from exporter.backends import tensorrt",
        "import exporter.backends.tensorrt",
        "if TYPE_CHECKING:\n    from exporter.backends import tensorrt",
        "def lower():\n    from exporter.backends import tensorrt",
    ],
    ids=["top", "import", "TYPE_CHECKING", "in a function"],
)
def test_an_import_counts_wherever_it_is(source: str) -> None:
    assert imports_in(source) == {"exporter.backends.tensorrt"}


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
