"""The exported program itself as the artifact: run by PyTorch, it checks export alone.

With `backend.device=cuda` the runtime moves it to the GPU as it loads it, so its latency can
sit next to a compiled backend's on the same device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from exporter.backends.common.artifact import Artifact, Output
from exporter.config import BackendConfig, FallbackConfig

if TYPE_CHECKING:
    from exporter.export import Exported

log = logging.getLogger(__name__)


@dataclass
class EagerConfig(BackendConfig):
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    name: str = "eager"
    atol: float = 1.0e-5
    rtol: float = 1.0e-4
    device: str = "cpu"


SCHEMA = EagerConfig
RUNTIME = "eager"
AUDIT = "exported_program"
DELEGATE = None


def check(backend: EagerConfig, fallback: FallbackConfig) -> None:
    from exporter.backends.common import torch_device

    torch_device.require(backend.device)


def output(backend: EagerConfig) -> Output:
    from exporter.export import PROGRAM_FILE

    return Output(file=PROGRAM_FILE, runtime=RUNTIME, audit=AUDIT, device=backend.device)


def toolchain(backend: EagerConfig) -> dict[str, str]:
    # The artifact is the exported program, whatever the device.
    return {}


def lower(
    exported: Exported, backend: EagerConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    # Nothing to lower and nothing to fall back from: every node runs in PyTorch, so every
    # fallback policy holds.
    log.info("[lower] eager: the exported program is the artifact")
    if not exported.path.exists():
        # A program made in memory (a part that localization cut) is saved where it says.
        import torch

        torch.export.save(exported.program, exported.path)
    return Artifact.at(exported.path, output(backend), partition=None)
