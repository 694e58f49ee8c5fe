"""The lowering stage, and the registry of backends: every module of this package is one backend.

A backend module declares (see `BackendModule`) its schema (a BackendConfig subclass holding the
backend's name, defaults and devices), the runtime that loads its artifact, and the functions
the stage calls. Everything else derives from those declarations: the config store registers
each schema as `schema/backend/<name>` (conf/backend/<name>.yaml selects it), the stage finds the
module by `backend.name`, and `runtimes.load` finds the runtime module by its name.

Composing a config imports every backend module, so a backend imports its toolchain (and
torch) inside its functions, never at the top.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from exporter.backends.common.artifact import Artifact, Output
from exporter.backends.common.partition import PARTITION_FILE, PartitionSummary, enforce
from exporter.config import BackendConfig, FallbackConfig, JobConfig
from exporter.errors import ConfigError
from exporter.files import write_json

if TYPE_CHECKING:
    from exporter.export import Exported

__all__ = [
    "Artifact",
    "BackendModule",
    "adopt",
    "check_fallback",
    "check_target",
    "declared",
    "half_precision",
    "lower",
    "lowered_in",
    "makes_runnable",
    "names",
    "schemas",
    "toolchain",
]


class BackendModule(Protocol):
    """What a module of this package declares."""

    # The backend's config: `name` defaults to the module's name; its other defaults, its own
    # settings and its `devices` are the backend's.
    SCHEMA: type[BackendConfig]
    # The module of the `runtimes` package that loads the artifact.
    RUNTIME: str
    # Its backend id in partition reports; None where nothing is delegated.
    DELEGATE: str | None
    # How the weights audit reads its artifact's weights: a key of exporter.audit.READERS (a
    # format's reader, or one that says why the format cannot be read). Its `output` passes it on.
    AUDIT: str
    # Optional: by model dtype, a measured statement of where its artifacts lose precision that
    # eager at that dtype does not, which a failed validation at that dtype quotes.
    HALF_PRECISION: dict[str, str]

    def output(self, backend: Any) -> Output:
        """The file a config of it makes (with `runtime=None` for a report with nothing to run)."""

    def check(self, backend: Any, fallback: FallbackConfig) -> None:
        """Raises ConfigError where the two contradict, or this machine lacks what it needs."""

    def toolchain(self, backend: Any) -> dict[str, str]:
        """What shapes its artifact besides the project's code and Python libraries (a compiler,
        a GPU): part of the lowering's cache key."""

    def lower(
        self, exported: Exported, backend: Any, fallback: FallbackConfig, out_dir: Path
    ) -> Artifact:
        """Writes the artifact into `out_dir`, mapping the fallback policy to its own controls."""


# The package of what several backends share (exporter/backends/common/): not a backend.
SHARED = "common"


@cache
def names() -> tuple[str, ...]:
    """Every backend, by module name."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != SHARED))


def declared(name: str) -> BackendModule:
    if name not in names():
        raise ConfigError(f"backend.name={name!r} is unknown; allowed: {', '.join(names())}.")
    module: Any = importlib.import_module(f"{__name__}.{name}")
    return module


def schemas() -> dict[str, type[BackendConfig]]:
    return {name: declared(name).SCHEMA for name in names()}


def check_target(job: JobConfig) -> None:
    """Raises ConfigError, before any work, where the backend cannot run on this machine."""
    declared(job.backend.name).check(job.backend, job.fallback)


def toolchain(job: JobConfig) -> dict[str, str]:
    return declared(job.backend.name).toolchain(job.backend)


def half_precision(job: JobConfig) -> str | None:
    """What the job's backend is known to lose at the model's dtype, if it declares it."""
    return getattr(declared(job.backend.name), "HALF_PRECISION", {}).get(job.model.dtype.value)


def makes_runnable(job: JobConfig) -> bool:
    """Whether the job's backend, as configured, makes an artifact to run (not a report)."""
    return declared(job.backend.name).output(job.backend).runtime is not None


def lower(exported: Exported, job: JobConfig, out_dir: Path) -> Artifact:
    """Writes the artifact file into `out_dir`, and partition.json where the backend partitions.

    The policy's partitioning settings shape what is lowered; whether `strict` holds is judged
    after, by `check_fallback`."""
    artifact = declared(job.backend.name).lower(exported, job.backend, job.fallback, out_dir)
    if artifact.partition:
        write_json(out_dir / PARTITION_FILE, artifact.partition.to_json())
    return artifact


def lowered_in(folder: Path, job: JobConfig) -> Artifact:
    """The artifact that `lower` wrote into `folder` (or a copy of that folder's files)."""
    partition_path = folder / PARTITION_FILE
    partition = (
        PartitionSummary.from_json(json.loads(partition_path.read_text()))
        if partition_path.exists()
        else None
    )
    output = declared(job.backend.name).output(job.backend)
    return Artifact.at(folder / output.file, output, partition)


def check_fallback(artifact: Artifact, job: JobConfig) -> None:
    """Raises LoweringFailed where `fallback` forbids what the partitioner left outside."""
    if artifact.partition:
        enforce(artifact.partition, job.fallback, declared(job.backend.name).DELEGATE)


def adopt(path: Path, job: JobConfig) -> Artifact:
    """A pre-built artifact (`artifact=PATH`) to validate as the backend's own output."""
    output = declared(job.backend.name).output(job.backend)
    expected = Path(output.file).suffix
    if output.runtime is None:
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
