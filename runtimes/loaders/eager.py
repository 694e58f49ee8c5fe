"""Runs a saved torch.export program (program.pt2) in PyTorch, on the CPU or a CUDA device; its
encode method too where the file holds one beside the model (a Whisper's), the two sharing the
state that encode writes and the model reads."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export import ExportedProgram
from torch.export.passes import move_to_device_pass
from torch.export.pt2_archive._package import load_pt2

from runtimes import int4_kernels
from runtimes.on_device import OnDevice

# The programs of a program.pt2 (exporter/export/__init__.py): the model's, and its decoder's
# encode method where it has one.
MODEL = "model"
ENCODE = "encode"

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch",)


def load(path: Path, device: str) -> ExportedProgramModule:
    return ExportedProgramModule(path, device)


class ExportedProgramModule(OnDevice):
    def __init__(self, path: Path, device: str = "cpu") -> None:
        on = torch.device(device)
        contents = load_pt2(path)
        # On CUDA too: the repacking into CUDA's tiles reads codes as this CPU packs them.
        int4_kernels.require_packing(contents.extra_files.get(int4_kernels.PACKING_KEY), path)
        programs = contents.exported_programs
        modules = {name: _on(program, on).module() for name, program in programs.items()}
        model, encode = modules[MODEL], modules.get(ENCODE)
        if encode is not None:
            _tie_buffers(encode, model)
        super().__init__(model, on, encode)


def _on(program: ExportedProgram, on: torch.device) -> ExportedProgram:
    if on.type != "cpu":
        program = move_to_device_pass(program, on)
    if on.type == "cuda":
        program = int4_kernels.program_for_cuda(program)
    return program


def _tie_buffers(module: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Each buffer of `module` that `owner` has under the same name made `owner`'s tensor, so
    what one writes the other reads."""
    owned = dict(owner.named_buffers())
    for name, _ in list(module.named_buffers()):
        if name in owned:
            parent, _, leaf = name.rpartition(".")
            holder = module.get_submodule(parent) if parent else module
            holder._buffers[leaf] = owned[name]
