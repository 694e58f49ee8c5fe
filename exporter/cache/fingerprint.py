"""What code computed a result: the source files that produce it and the library versions they use.

The cache keys its entries by hashed material; with the config and torch's version alone, an
edited model file, a transformers upgrade or an edited lowering step would leave the cache
certifying a stale artifact. `code_of` follows the imports of the code that produces a result
and hashes every source it reaches, so each key changes exactly when that code does.

It reads files with `ast` and imports nothing: fingerprinting must stay cheap (no torch), must
not run a module's side effects, and must see toolchains that are not installed. For the same
reason this module imports only the standard library.
"""

from __future__ import annotations

import ast
import csv
import functools
import hashlib
import importlib.metadata
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def code_of(
    modules: Sequence[str],
    files: Sequence[Path] = (),
    roots: Sequence[Path] = (PROJECT_ROOT,),
) -> dict[str, dict[str, str]]:
    """The sources (path relative to its root, else absolute -> SHA-256 prefix) and the libraries
    (distribution -> version) of `modules` and `files` and of everything they import, lazily
    inside functions too. A file's own directory resolves its imports of its siblings."""
    roots = [root.resolve() for root in roots]
    files = [Path(file).resolve() for file in files]
    search = list(dict.fromkeys([*roots, *(file.parent for file in files)]))
    pending = [(file, file.stem) for file in files]
    for name in modules:
        path = _find(name, search)
        if path is None:
            raise ValueError(f"no source of module {name} under {', '.join(map(str, search))}")
        pending.append((path, name))
    sources: dict[str, str] = {}
    libraries: dict[str, str] = {}
    seen: set[Path] = set()
    while pending:
        path, name = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        sources[_label(path, roots)] = hashlib.sha256(text).hexdigest()[:16]
        tree = ast.parse(text, filename=str(path))
        for candidates in _imports(tree, name, is_package=path.name == "__init__.py"):
            for candidate in candidates:
                if found := _find(candidate, search):
                    pending.append((found, candidate))
                    break
            else:
                libraries.update(_library(candidates[-1]))
    return {"sources": dict(sorted(sources.items())), "libraries": dict(sorted(libraries.items()))}


def library_version(distribution: str) -> str:
    """The installed version of `distribution`, or "not installed"."""
    return _installed_version(distribution)


@functools.cache
def _installed_version(distribution: str) -> str:
    """library_version's lookup, once a process: each scans every installed distribution's
    folder (~5 ms), and a job's keys ask for torch's and the others' versions hundreds of times."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _library(module: str) -> dict[str, str]:
    """The distributions (-> versions) a module found under no root comes from: none for the
    standard library, else those of its top-level name, or that name itself when no installed
    distribution provides it, so that a missing optional toolchain still shows."""
    top = module.partition(".")[0]
    if top in sys.stdlib_module_names:  # __future__ is one of them
        return {}
    return {name: library_version(name) for name in _distributions().get(top, [top])}


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """Top-level import name -> the distributions that provide it, as
    importlib.metadata.packages_distributions() maps them; built once."""
    found: dict[str, set[str]] = {}
    for distribution in importlib.metadata.distributions():
        for name in _top_level_names(distribution):
            found.setdefault(name, set()).add(distribution.metadata["Name"])
    return {name: sorted(distributions) for name, distributions in found.items()}


def _top_level_names(distribution: importlib.metadata.Distribution) -> set[str]:
    """The names a distribution declares in top_level.txt, else its .py files' top folders (or
    a top-level module's name). The files come from its RECORD's text: `Distribution.files`
    checks that each exists, a stat for each of torch's 15,000, a second of every job's CPU."""
    declared = (distribution.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    record = distribution.read_text("RECORD")
    if record is None:
        paths = [file.as_posix() for file in distribution.files or ()]
    else:
        paths = [row[0] for row in csv.reader(record.splitlines()) if row]
    names = set()
    for path in paths:
        if path.endswith(".py"):
            top, nested, _ = path.partition("/")
            names.add(top if nested else top.removesuffix(".py"))
    return names


def _imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, ...]]:
    """Each import in the tree as the module names it may mean, the likeliest first: `from a.b
    import c` is module a.b.c if there is one, else a.b. A submodule's parent packages are not
    listed: a package's `__init__` may import every sibling (every model), and one model's key
    must not change when another model's file is edited. Imports under `if TYPE_CHECKING:`
    never run, so they are not followed."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in _running_nodes(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name,) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            elif node.level - 1 < len(package):
                base = ".".join([*package[: len(package) - node.level + 1], node.module or ""])
            else:
                continue  # beyond the top-level package: fails at import time, imports nothing
            base = base.strip(".")
            yield from ((f"{base}.{alias.name}", base) for alias in node.names)


def _running_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node of the tree but those under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in _TYPE_CHECKING:
            yield from (n for orelse in child.orelse for n in (orelse, *_running_nodes(orelse)))
            continue
        yield child
        yield from _running_nodes(child)


def _find(module: str, roots: Sequence[Path]) -> Path | None:
    """The file of a dotted module under the first root that has it, by path alone: find_spec
    would import the parent packages."""
    for root in roots:
        base = root.joinpath(*module.split("."))
        for path in (base / "__init__.py", base.parent / f"{base.name}.py"):
            if path.is_file():
                return path
    return None


def _label(path: Path, roots: Sequence[Path]) -> str:
    for root in roots:
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return str(path)
