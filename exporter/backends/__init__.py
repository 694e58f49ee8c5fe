"""The lowering stage: an exported program -> the backend's deployable Artifact."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from exporter.backends.artifact import Artifact
from exporter.backends.partition import PartitionSummary
from exporter.config import JobConfig
from exporter.errors import ConfigError
from exporter.export import Exported

__all__ = ["Artifact", "PartitionSummary", "adopt", "lower"]

# Each backend module has FORMAT, ARTIFACT_FILE and lower(exported, backend, fallback, out_dir).
# Imported on use: a job pays only for the toolchain of its own backend.
_BACKENDS = ("eager", "executorch")


def _backend(name: str) -> ModuleType:
    if name not in _BACKENDS:
        raise ConfigError(f"backend.name={name!r} is unknown; allowed: {', '.join(_BACKENDS)}.")
    return importlib.import_module(f"exporter.backends.{name}")


def lower(exported: Exported, job: JobConfig, out_dir: Path) -> Artifact:
    return _backend(job.backend.name).lower(exported, job.backend, job.fallback, out_dir)


def adopt(path: Path, job: JobConfig) -> Artifact:
    """A pre-built artifact (`artifact=PATH`) to validate as the backend's own output."""
    backend = _backend(job.backend.name)
    expected = Path(backend.ARTIFACT_FILE).suffix
    if path.suffix != expected:
        raise ConfigError(
            f"artifact={path}: backend={job.backend.name} runs {expected} files, "
            f"not {path.suffix!r}."
        )
    return Artifact(path=path, format=backend.FORMAT, partition=None)
