"""Runs a saved torch.export program (program.pt2) in PyTorch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import _pytree as pytree


class ExportedProgramModule:
    def __init__(self, path: Path) -> None:
        self._module = torch.export.load(path).module()

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(pytree.tree_leaves(self._module(*inputs)))
