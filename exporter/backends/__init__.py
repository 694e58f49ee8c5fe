"""The lowering stage: an exported program -> the backend's deployable Artifact."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

from exporter.backends.artifact import Artifact
from exporter.backends.partition import PARTITION_FILE, PartitionSummary, enforce
from exporter.config import JobConfig
from exporter.errors import ConfigError
from exporter.export import Exported
from exporter.files import write_json

__all__ = ["Artifact", "PartitionSummary", "adopt", "check_fallback", "lower", "lowered_in"]

# Each backend module has FORMAT, ARTIFACT_FILE, DELEGATE (None where nothing is delegated) and
# lower(exported, backend, fallback, out_dir), which maps the fallback policy to its own controls.
# Imported on use: a job pays only for the toolchain of its own backend.
_BACKENDS = ("eager", "executorch")


def _backend(name: str) -> ModuleType:
    if name not in _BACKENDS:
        raise ConfigError(f"backend.name={name!r} is unknown; allowed: {', '.join(_BACKENDS)}.")
    return importlib.import_module(f"exporter.backends.{name}")


def lower(exported: Exported, job: JobConfig, out_dir: Path) -> Artifact:
    """Writes the artifact file into `out_dir`, and partition.json where the backend partitions.

    The policy's partitioning settings shape what is lowered; whether `strict` holds is judged
    after, by `check_fallback`."""
    artifact = _backend(job.backend.name).lower(exported, job.backend, job.fallback, out_dir)
    if artifact.partition:
        write_json(out_dir / PARTITION_FILE, artifact.partition.to_json())
    return artifact


def lowered_in(folder: Path, job: JobConfig) -> Artifact:
    """The artifact that `lower` wrote into `folder` (or a copy of that folder's files)."""
    backend = _backend(job.backend.name)
    partition_path = folder / PARTITION_FILE
    partition = (
        PartitionSummary.from_json(json.loads(partition_path.read_text()))
        if partition_path.exists()
        else None
    )
    return Artifact(path=folder / backend.ARTIFACT_FILE, format=backend.FORMAT, partition=partition)


def check_fallback(artifact: Artifact, job: JobConfig) -> None:
    """Raises LoweringFailed where `fallback` forbids what the partitioner left outside."""
    if artifact.partition:
        enforce(artifact.partition, job.fallback, _backend(job.backend.name).DELEGATE)


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
