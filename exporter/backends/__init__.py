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

__all__ = [
    "Artifact",
    "PartitionSummary",
    "adopt",
    "check_fallback",
    "check_target",
    "lower",
    "lowered_in",
    "toolchain",
]

# Each backend module has DELEGATE (its backend id in partition reports; None where nothing is
# delegated) and
# check(backend, fallback): raises ConfigError where the two contradict, or this machine lacks
# what the backend needs;
# output(backend): the Output (file name, runtime format, device) a config of it makes;
# toolchain(backend): the versions and device that shape its artifact (part of the cache key);
# lower(exported, backend, fallback, out_dir), which maps the fallback policy to its own controls.
# Imported on use: a job pays only for the toolchain of its own backend.
_BACKENDS = ("eager", "executorch", "aoti", "tensorrt", "webgpu")


def _backend(name: str) -> ModuleType:
    if name not in _BACKENDS:
        raise ConfigError(f"backend.name={name!r} is unknown; allowed: {', '.join(_BACKENDS)}.")
    return importlib.import_module(f"exporter.backends.{name}")


def check_target(job: JobConfig) -> None:
    """Raises ConfigError, before any work, where the backend cannot run on this machine."""
    _backend(job.backend.name).check(job.backend, job.fallback)


def toolchain(job: JobConfig) -> dict[str, str]:
    return _backend(job.backend.name).toolchain(job.backend)


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
    output = backend.output(job.backend)
    return Artifact.at(folder / output.file, output, partition)


def check_fallback(artifact: Artifact, job: JobConfig) -> None:
    """Raises LoweringFailed where `fallback` forbids what the partitioner left outside."""
    if artifact.partition:
        enforce(artifact.partition, job.fallback, _backend(job.backend.name).DELEGATE)


def adopt(path: Path, job: JobConfig) -> Artifact:
    """A pre-built artifact (`artifact=PATH`) to validate as the backend's own output."""
    output = _backend(job.backend.name).output(job.backend)
    expected = Path(output.file).suffix
    if output.format is None:
        raise ConfigError(
            f"artifact={path}: backend={job.backend.name} with these settings makes a report, "
            "not an artifact to run."
        )
    if path.suffix != expected:
        raise ConfigError(
            f"artifact={path}: backend={job.backend.name} runs {expected} files, "
            f"not {path.suffix!r}."
        )
    return Artifact.at(path, output, partition=None)
