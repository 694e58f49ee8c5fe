"""Runs a .pte with ExecuTorch's runtime (its Python bindings over the C++ runtime)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from executorch.runtime import Runtime, Verification


def load(path: Path, device: str) -> ExecutorchProgram:
    if device != "cpu":
        raise ValueError(f"a .pte of the XNNPACK delegate runs on the CPU, not on {device}")
    return ExecutorchProgram(path)


class ExecutorchProgram:
    def __init__(self, path: Path, method: str = "forward") -> None:
        program = Runtime.get().load_program(path, verification=Verification.Minimal)
        self._method = program.load_method(method)
        # The program owns the method's memory; it must live as long as the method.
        self._program = program

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        outputs = self._method.execute(list(inputs))
        # Outputs may alias the method's planned memory, which the next execute overwrites.
        return tuple(output.clone() for output in outputs)
