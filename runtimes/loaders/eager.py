"""Runs a saved torch.export program (program.pt2) in PyTorch, on the CPU or a CUDA device."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass

from runtimes import int4_kernels
from runtimes.on_device import OnDevice

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch",)


def load(path: Path, device: str) -> ExportedProgramModule:
    return ExportedProgramModule(path, device)


class ExportedProgramModule(OnDevice):
    def __init__(self, path: Path, device: str = "cpu") -> None:
        on = torch.device(device)
        program = torch.export.load(path)
        if on.type != "cpu":
            program = move_to_device_pass(program, on)
        if on.type == "cuda":
            program = int4_kernels.program_for_cuda(program)
        super().__init__(program.module(), on)
