"""Runs a saved torch.export program (program.pt2) in PyTorch, on the CPU or a CUDA device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass

from runtimes import on_device


def load(path: Path, device: str) -> ExportedProgramModule:
    return ExportedProgramModule(path, device)


class ExportedProgramModule:
    def __init__(self, path: Path, device: str = "cpu") -> None:
        self._device = torch.device(device)
        program = torch.export.load(path)
        if self._device.type != "cpu":
            program = move_to_device_pass(program, self._device)
        self._module = program.module()

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return on_device.call(self._module, inputs, self._device)
