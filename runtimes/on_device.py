"""Calling a PyTorch-run artifact on its device with CPU tensors in and out, as `Loaded` says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


def call(
    artifact: Callable[..., Any], inputs: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        outputs = artifact(*(x.to(device) for x in inputs))
    # .cpu() waits for the device, so a caller's timing covers the whole computation.
    return tuple(output.cpu() for output in pytree.tree_leaves(outputs))
