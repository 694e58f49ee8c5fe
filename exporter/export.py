"""The export stage: torch.export with a `Dim` per declared dynamic dim, saved as program.pt2."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

from exporter.errors import ExportFailed
from exporter.files import atomic_path
from exporter.models import ModelBundle

log = logging.getLogger(__name__)

PROGRAM_FILE = "program.pt2"


@dataclass(frozen=True)
class Exported:
    program: ExportedProgram
    path: Path


def dynamic_shapes(bundle: ModelBundle) -> tuple[dict[int, Any] | None, ...]:
    """torch.export's spec, positional: one shared `Dim` per named dim on every axis carrying it."""
    spec: dict[str, dict[int, Any] | None] = {name: None for name in bundle.input_names}
    for dim in bundle.dims:
        # A dim whose bounds meet is static: exporting it as a Dim would be refused.
        if dim.min == dim.max:
            continue
        export_dim = Dim(dim.name, min=dim.min, max=dim.max)
        for input_name, axis in dim.axes:
            spec[input_name] = {**(spec[input_name] or {}), axis: export_dim}
    return tuple(spec[name] for name in bundle.input_names)


def run(bundle: ModelBundle, out_dir: Path) -> Exported:
    example = bundle.make_inputs(bundle.max_sizes(), 0)
    bounds = ", ".join(f"{d.name} in [{d.min}, {d.max}]" for d in bundle.dims)
    log.info("[export] torch.export of %s with %s", bundle.name, bounds)
    try:
        program = torch.export.export(
            bundle.module, example, dynamic_shapes=dynamic_shapes(bundle), strict=False
        )
    except Exception as error:
        raise ExportFailed(f"torch.export failed: {type(error).__name__}: {error}") from error
    path = out_dir / PROGRAM_FILE
    with atomic_path(path) as temporary:
        torch.export.save(program, temporary)
    return Exported(program=program, path=path)


def load(path: Path) -> Exported:
    """A program that `run` saved, as `run` returned it."""
    return Exported(program=torch.export.load(path), path=path)
