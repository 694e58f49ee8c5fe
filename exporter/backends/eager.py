"""The exported program itself as the artifact: run by PyTorch, it checks export alone."""

from __future__ import annotations

import logging
from pathlib import Path

from exporter.backends.artifact import Artifact
from exporter.config import BackendConfig, FallbackConfig
from exporter.export import Exported

log = logging.getLogger(__name__)

FORMAT = "exported_program"
ARTIFACT_FILE = "program.pt2"
DELEGATE = None


def lower(
    exported: Exported, backend: BackendConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    # Nothing to lower and nothing to fall back from: every node runs in PyTorch, so every
    # fallback policy holds.
    log.info("[lower] eager: the exported program is the artifact")
    return Artifact(path=exported.path, format=FORMAT, partition=None)
