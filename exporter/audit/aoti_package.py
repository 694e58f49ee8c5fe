"""The weights an AOTInductor package carries. The project packages them as one pickled tensor
per weight (exporter/backends/aoti.py: data/weights/, mapped by
data/aotinductor/<model>/weights_config.json from each weight's fully qualified name to its file
and its view: shape, stride, offset; weights that share storage share a file). The package's
wrapper.cpp declares every constant its compiled code reads (`constants_info_[i].original_fqn`).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from exporter.audit.matching import Constant

_WEIGHTS_CONFIG = re.compile(r"(.*/)?data/aotinductor/[^/]+/weights_config\.json")
_WRAPPER = re.compile(r"(.*/)?data/aotinductor/[^/]+/[^/]+\.wrapper\.cpp")
_DECLARED = re.compile(r'constants_info_\[\d+\]\.original_fqn = "([^"]*)";')
# Inductor writes a 1-D constant of at most this many elements into its kernels as literals
# (torch._inductor.graph.GraphLowering.can_inline_constant).
_INLINED = 8


def package_weights(path: Path) -> tuple[list[Constant], set[str], bool]:
    """The package's weights (by name), the names its compiled code declares, and whether it
    has pickled weights at all (without, they are in the .so's data section)."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        declared: set[str] = set()
        for name in names:
            if _WRAPPER.fullmatch(name):
                declared.update(_DECLARED.findall(archive.read(name).decode()))
        configs = [n for n in names if _WEIGHTS_CONFIG.fullmatch(n)]
        if not configs:
            return [], declared, False
        constants = list(_weights(archive, configs))
    return constants, declared, True


def _weights(archive: zipfile.ZipFile, configs: list[str]) -> Iterator[Constant]:
    for config_name in configs:
        root = config_name.split("data/aotinductor/")[0]
        config: Mapping[str, list] = json.loads(archive.read(config_name))
        by_file: dict[str, list[tuple[str, list]]] = {}
        for fqn, entry in config.items():
            by_file.setdefault(entry[0], []).append((fqn, entry))
        for file, entries in by_file.items():
            # One file's tensor at a time, and each weight's bytes taken from it.
            stored = torch.load(
                io.BytesIO(archive.read(f"{root}data/weights/{file}")), weights_only=True
            )
            for fqn, (_file, shape, stride, offset) in entries:
                view = torch.as_strided(stored.detach(), shape, stride, offset).contiguous()
                yield Constant(
                    where=f"package weight {file}",
                    data=memoryview(view.reshape(-1).view(torch.uint8).numpy()),
                    dtype=view.dtype,
                    shape=tuple(shape),
                    name=fqn,
                )
            del stored


def why_unseen(parameter: torch.Tensor, name: str, declared: set[str], pickled: bool) -> str:
    if not pickled:
        return (
            "the package keeps its weights in the .so's data section (no weights_config.json), "
            "which the audit does not read"
        )
    if name in declared:
        return "the compiled code reads it, but the package holds no weights file for it"
    if parameter.dim() == 1 and parameter.shape[0] <= _INLINED:
        return (
            f"a 1-D constant of at most {_INLINED} elements: Inductor writes it into its kernels "
            "as literals, not into the package's weights"
        )
    return (
        "the compiled code reads no constant of this name (the program does not use it, or "
        "Inductor folded it into another)"
    )
