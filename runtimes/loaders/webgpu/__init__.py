"""Run ExecuTorch programs lowered for WebGPU (VulkanBackend payloads) without executorch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtimes.loaders.webgpu.program import WebgpuProgram

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch", "wgpu", "flatbuffers", "numpy")


def has_kernel(op: str) -> bool:
    """Whether a delegate may hold `op`: this runtime has a kernel for the op of this name, the
    name a VkGraph's operator call gives it (an edge op's, "aten.gelu.default")."""
    from runtimes.loaders.webgpu import kernels

    return op in kernels.BUILDERS


def load(path: Path, device: str) -> WebgpuProgram:
    """`device`: the wgpu adapter choice, auto, gpu or cpu."""
    from runtimes.loaders.webgpu.program import WebgpuProgram

    return WebgpuProgram(path, device)
