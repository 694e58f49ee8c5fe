"""The exported program itself as the artifact: run by PyTorch, it checks export alone.

With `backend.device=cuda` the runtime moves it to the GPU as it loads it, so its latency can
sit next to a compiled backend's on the same device.
"""

from __future__ import annotations

import logging
from pathlib import Path

from exporter.backends import device
from exporter.backends.artifact import Artifact, Output
from exporter.config import BackendConfig, FallbackConfig
from exporter.export import PROGRAM_FILE, Exported

log = logging.getLogger(__name__)

DELEGATE = None


def check(backend: BackendConfig, fallback: FallbackConfig) -> None:
    device.require(backend.device)


def output(backend: BackendConfig) -> Output:
    return Output(file=PROGRAM_FILE, format="exported_program", device=backend.device)


def toolchain(backend: BackendConfig) -> dict[str, str]:
    return {"device": device.describe(backend.device)}


def lower(
    exported: Exported, backend: BackendConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    # Nothing to lower and nothing to fall back from: every node runs in PyTorch, so every
    # fallback policy holds.
    log.info("[lower] eager: the exported program is the artifact")
    return Artifact.at(exported.path, output(backend), partition=None)
