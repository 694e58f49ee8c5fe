"""Run ExecuTorch programs lowered for WebGPU (VulkanBackend payloads) without executorch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtimes.loaders.webgpu.program import WebgpuProgram

# The distributions it loads artifacts with, whose versions a check's report records.
PACKAGES = ("torch", "wgpu", "flatbuffers", "numpy")


def load(path: Path, device: str) -> WebgpuProgram:
    """`device`: the wgpu adapter choice, auto, gpu or cpu."""
    from runtimes.loaders.webgpu.program import WebgpuProgram

    return WebgpuProgram(path, device)
