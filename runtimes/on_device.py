"""Running a PyTorch-run artifact on its device with CPU tensors in and out, as `Loaded` says,
in the three steps a benchmark times apart: copy in, compute, copy out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from runtimes.cpu_arithmetic import describe_cpu


class OnDevice:
    """A callable artifact on a torch device. On CUDA, `execute` returns once the kernels are
    queued (its `clock` says so, and a benchmark times it with CUDA events); `upload` and
    `download` return once their copies are done. `encode`: the artifact's encode method, where
    it has one (Loaded)."""

    def __init__(
        self,
        artifact: Callable[..., Any],
        device: torch.device,
        encode: Callable[..., Any] | None = None,
    ) -> None:
        self._artifact = artifact
        self._encode = encode
        self._device = device
        self.clock = "cuda" if device.type == "cuda" else "cpu"
        # What ran it, as `Loaded.target` says: a GPU by its name (tags target.cuda_device), a
        # CPU by its name and half-precision features.
        self.target = (
            {"cuda_device": torch.cuda.get_device_name(device)}
            if self.clock == "cuda"
            else describe_cpu()
        )

    def upload(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        resident = [x.to(self._device) for x in inputs]
        _synchronize(self._device)
        return resident

    def execute(self, resident: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return pytree.tree_leaves(self._artifact(*resident))

    def download(self, produced: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # .cpu() waits for the device, so `run` returns only once the computation is done.
        return tuple(output.cpu() for output in produced)

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.download(self.execute(self.upload(inputs)))

    def encode(self, inputs: Sequence[torch.Tensor]) -> None:
        if self._encode is None:
            raise ValueError("the artifact has no encode method")
        with torch.no_grad():
            self._encode(*self.upload(inputs))
        _synchronize(self._device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
