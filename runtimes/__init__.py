"""Loaders that run an artifact on its target. Independent of the exporter: a target needs only
the artifact file, its format, and this package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch


class Loaded(Protocol):
    """A loaded artifact; `run` may be called many times, with inputs of any in-bound shape."""

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...


def _load_pte(path: Path) -> Loaded:
    from runtimes.executorch import ExecutorchProgram

    return ExecutorchProgram(path)


def _load_exported_program(path: Path) -> Loaded:
    from runtimes.eager import ExportedProgramModule

    return ExportedProgramModule(path)


# Imported lazily so a target installs only the runtime its format needs.
LOADERS: dict[str, Callable[[Path], Loaded]] = {
    "pte": _load_pte,
    "exported_program": _load_exported_program,
}


def load(path: Path, format: str) -> Loaded:
    if format not in LOADERS:
        raise ValueError(f"no runtime for format {format!r}; known: {', '.join(LOADERS)}")
    return LOADERS[format](path)
