"""Runs what torch_tensorrt.save wrote, on CUDA, in each of its output formats, told apart by
the file's suffix: a torch.export program (.ep), an ExecuTorch program (.pte), an AOTInductor
package (.pt2).

Importing torch_tensorrt registers the ops and classes that hold TensorRT engines
(tensorrt::execute_engine), without which no format loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from runtimes.loaders.aoti import AotiPackage
from runtimes.on_device import OnDevice

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch", "torch_tensorrt", "tensorrt")


def load(path: Path, device: str) -> TensorrtProgram | TensorrtExecutorchProgram | AotiPackage:
    loaders = {
        ".ep": TensorrtProgram,
        ".pte": TensorrtExecutorchProgram,
        ".pt2": tensorrt_aoti_package,
    }
    if path.suffix not in loaders:
        raise ValueError(
            f"{path}: torch_tensorrt.save writes {', '.join(loaders)} files, not {path.suffix!r}"
        )
    return loaders[path.suffix](path, device)


class TensorrtProgram(OnDevice):
    """A torch.export program whose TensorRT-compiled parts call engines (model.ep)."""

    def __init__(self, path: Path, device: str = "cuda") -> None:
        import torch_tensorrt

        super().__init__(torch_tensorrt.load(str(path)).module(), torch.device(device))


class TensorrtExecutorchProgram:
    """An ExecuTorch program with TensorRT delegates (model.pte), run by the ExecuTorch runtime
    that torch-tensorrt-executorch-runtime ships: CPU tensors in and out, engines on the GPU."""

    def __init__(self, path: Path, device: str = "cuda") -> None:
        import torch_tensorrt

        if device != "cuda":
            raise ValueError(f"TensorRT engines run on CUDA, not on {device}")
        self._program = torch_tensorrt.load(str(path), format="executorch")

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        outputs = self._program.run(list(inputs))
        # Outputs may alias the runtime's planned memory, which the next run overwrites.
        return tuple(output.clone() for output in outputs)


def tensorrt_aoti_package(path: Path, device: str = "cuda") -> AotiPackage:
    """An AOTInductor package whose kernels include TensorRT engines (model.pt2)."""
    import torch_tensorrt  # noqa: F401

    return AotiPackage(path, device)
