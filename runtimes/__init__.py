"""What a target needs to run and judge an artifact, independent of the exporter: the loaders
(runtimes/loaders/, one per runtime), the formats of the files it gets (runtimes/formats/: the
.pte, the bundle), the verdict that judges outputs against goldens (runtimes/verdict/), the check
that validates a bundle there (`python -m runtimes.check BUNDLE`), and what runs the exported
model there (`python -m runtimes.run BUNDLE generate`: runtimes/generation.py).

Every module (or subpackage) of runtimes/loaders/ is one runtime, with a
`load(path: Path, device: str) -> Loaded` and the `PACKAGES` (distributions) it loads artifacts
with, and a `DATA_SUFFIX` where it loads a data file beside the artifact; it is imported only
when its artifact is loaded, so a target installs only the toolchain its own runtime needs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from runtimes import loaders

if TYPE_CHECKING:
    import torch


class Loaded(Protocol):
    """A loaded artifact; `run` may be called many times, with inputs of any in-bound shape.

    Inputs and outputs are CPU tensors: a loader on another device copies them, and its `run`
    returns only once the device has finished. A runtime that picks its device itself (a wgpu
    adapter) also says what it picked in `target`, a mapping of names to values.

    A runtime may also offer `run`'s three steps apart, for a benchmark to time the computation
    without the copies (exporter/benchmark/): `upload(inputs)` copies the inputs to the target,
    `execute(resident)` computes, `download(produced)` copies the outputs back as CPU tensors;
    `clock` names what times `execute`: "cpu" (it returns once done, a host clock times it) or
    "cuda" (it returns once the kernels are queued; CUDA events time it).

    An artifact of a decoder that attends to an encoded input (Whisper's) also has
    `encode(inputs)`, its encode method, which writes the state its `run` then reads."""

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...


def names() -> list[str]:
    """Every runtime, by its loader's module name."""
    return sorted(m.name for m in pkgutil.iter_modules(loaders.__path__))


def load(path: Path, runtime: str, device: str = "cpu") -> Loaded:
    return _module(runtime).load(path, device)


def packages(runtime: str) -> tuple[str, ...]:
    """The distributions the runtime loads artifacts with, as its loader declares them."""
    return tuple(_module(runtime).PACKAGES)


def data_file_beside(path: Path, runtime: str) -> Path | None:
    """The data file that the runtime loads with the artifact at `path`, where one lies beside it
    under the artifact's name (its loader's `DATA_SUFFIX`: ExecuTorch's .ptd), else None."""
    suffix = getattr(_module(runtime), "DATA_SUFFIX", None)
    beside = path.with_suffix(suffix) if suffix else None
    return beside if beside is not None and beside.exists() else None


def set_threads(runtime: str, count: int) -> None:
    """Sets the CPU threads the runtime's kernels use: its own `set_threads` where it has a
    thread pool of its own, else torch's intra-op threads, which every other runtime here
    computes with on the CPU."""
    module = _module(runtime)
    if hasattr(module, "set_threads"):
        module.set_threads(count)
    else:
        import torch

        torch.set_num_threads(count)


def _module(runtime: str) -> ModuleType:
    if runtime not in names():
        raise ValueError(f"no runtime {runtime!r}; known: {', '.join(names())}")
    return importlib.import_module(f"{loaders.__name__}.{runtime}")
