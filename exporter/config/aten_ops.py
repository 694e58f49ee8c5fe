"""The ATen operator overloads torch declares, read from its own declarations file without
loading torch (which takes seconds): torchgen's native_functions.yaml, shipped in the torch
wheel, with the overloads it generates (`autogen`). `fallback.ops` names are checked against it
when the config is composed."""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

_DECLARATIONS = Path("packaged", "ATen", "native", "native_functions.yaml")
# "- func: add.Tensor(Tensor self, ...)" and "  autogen: add.out, _foo"
_FUNC = re.compile(r"^- func: (\w+)(?:\.(\w+))?\(", re.MULTILINE)
_AUTOGEN = re.compile(r"^  autogen: (.+)$", re.MULTILINE)


@cache
def declared() -> frozenset[str] | None:
    """Every ATen overload as "name.overload" ("nonzero.default"); None where the installed
    torch ships no declarations file, and names cannot be checked."""
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0], _DECLARATIONS)
    if not path.is_file():
        return None
    text = path.read_text()
    names = {f"{name}.{overload or 'default'}" for name, overload in _FUNC.findall(text)}
    for line in _AUTOGEN.findall(text):
        for generated in line.split(","):
            name, _, overload = generated.strip().partition(".")
            names.add(f"{name}.{overload or 'default'}")
    return frozenset(names)
