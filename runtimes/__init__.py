"""Loaders that run an artifact on its target. Independent of the exporter: a target needs only
the artifact file, the name of its runtime, the device to run it on, and this package.

Every module (or subpackage) of this package is one runtime, with a
`load(path: Path, device: str) -> Loaded`; it is imported only when its artifact is loaded, so a
target installs only the toolchain its own runtime needs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

# Modules of this package that are helpers of runtimes, not runtimes.
_HELPERS = ("on_device",)


class Loaded(Protocol):
    """A loaded artifact; `run` may be called many times, with inputs of any in-bound shape.

    Inputs and outputs are CPU tensors: a loader on another device copies them, and its `run`
    returns only once the device has finished. A runtime that picks its device itself (a wgpu
    adapter) also says what it picked in `target`, a mapping of names to values."""

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...


def names() -> list[str]:
    """Every runtime of this package, by module name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _HELPERS)


def load(path: Path, runtime: str, device: str = "cpu") -> Loaded:
    if runtime not in names():
        raise ValueError(f"no runtime {runtime!r}; known: {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{runtime}").load(path, device)
