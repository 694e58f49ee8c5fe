"""Loaders that run an artifact on its target. Independent of the exporter: a target needs only
the artifact file, its format, the device to run it on, and this package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch


class Loaded(Protocol):
    """A loaded artifact; `run` may be called many times, with inputs of any in-bound shape.

    Inputs and outputs are CPU tensors: a loader on another device copies them, and its `run`
    returns only once the device has finished. A runtime that picks its device itself (a wgpu
    adapter) also says what it picked in `target`, a mapping of names to values."""

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...


def _load_pte(path: Path, device: str) -> Loaded:
    if device != "cpu":
        raise ValueError(f"a .pte of the XNNPACK delegate runs on the CPU, not on {device}")
    from runtimes.executorch import ExecutorchProgram

    return ExecutorchProgram(path)


def _load_exported_program(path: Path, device: str) -> Loaded:
    from runtimes.eager import ExportedProgramModule

    return ExportedProgramModule(path, device)


def _load_aoti_package(path: Path, device: str) -> Loaded:
    from runtimes.aoti import AotiPackage

    return AotiPackage(path, device)


def _load_tensorrt_program(path: Path, device: str) -> Loaded:
    from runtimes.tensorrt import TensorrtProgram

    return TensorrtProgram(path, device)


def _load_tensorrt_pte(path: Path, device: str) -> Loaded:
    from runtimes.tensorrt import TensorrtExecutorchProgram

    return TensorrtExecutorchProgram(path, device)


def _load_tensorrt_aoti(path: Path, device: str) -> Loaded:
    from runtimes.tensorrt import tensorrt_aoti_package

    return tensorrt_aoti_package(path, device)


def _load_webgpu_pte(path: Path, device: str) -> Loaded:
    from runtimes.webgpu.program import WebgpuProgram

    return WebgpuProgram(path, device)


# Imported lazily so a target installs only the runtime its format needs.
LOADERS: dict[str, Callable[[Path, str], Loaded]] = {
    "pte": _load_pte,
    "exported_program": _load_exported_program,
    "aoti_package": _load_aoti_package,
    "tensorrt_program": _load_tensorrt_program,
    "tensorrt_pte": _load_tensorrt_pte,
    "tensorrt_aoti": _load_tensorrt_aoti,
    "webgpu_pte": _load_webgpu_pte,
}


def load(path: Path, format: str, device: str = "cpu") -> Loaded:
    if format not in LOADERS:
        raise ValueError(f"no runtime for format {format!r}; known: {', '.join(LOADERS)}")
    return LOADERS[format](path, device)
