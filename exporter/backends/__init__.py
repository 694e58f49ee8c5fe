"""The lowering stage, and the registry of backends: every module of this package is one backend.

A backend module declares one `Backend` (exporter/backends/common/declaration.py) as `BACKEND`:
its schema, runtime, delegate, weights reader and half-precision losses, and the methods that
check, key and lower. Everything else derives from that declaration: the config store registers
each schema as `schema/backend/<name>` (conf/backend/<name>.yaml selects it), `configured(job)`
binds the job's backend to its config and fallback policy for the stages, `runtimes.load` finds
the runtime by its name, and the weights audit reads the artifact with the declared reader.
`declared` refuses a module whose declaration lacks a part, naming the backend and the part.

Composing a config imports every backend module, so a backend imports its toolchain (and
torch) inside its functions, never at the top.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import runtimes
from exporter.artifact import Artifact, Output, WeightsReader
from exporter.artifact.partition import PARTITION_FILE, PartitionSummary
from exporter.backends.common.declaration import Backend
from exporter.backends.common.strict import enforce
from exporter.config import BackendConfig, FallbackConfig, JobConfig, LlmOps
from exporter.errors import ConfigError
from exporter.files import write_json

if TYPE_CHECKING:
    from exporter.export import Exported

__all__ = [
    "Backend",
    "ConfiguredBackend",
    "InvalidDeclaration",
    "configured",
    "declaration_of",
    "declared",
    "names",
    "schemas",
]

# The package of what several backends share (exporter/backends/common/): not a backend.
SHARED = "common"


class InvalidDeclaration(TypeError):
    """A backend module whose declaration lacks a part, or has one of the wrong kind."""


@cache
def names() -> tuple[str, ...]:
    """Every backend, by module name."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != SHARED))


@cache
def declared(name: str) -> Backend:
    if name not in names():
        raise ConfigError(f"backend.name={name!r} is unknown; allowed: {', '.join(names())}.")
    return declaration_of(name, importlib.import_module(f"{__name__}.{name}"))


def declaration_of(name: str, module: ModuleType) -> Backend:
    """The module's `BACKEND`, once every part of it is there and of its kind; else
    InvalidDeclaration naming the backend and each part it lacks."""
    backend = getattr(module, "BACKEND", None)
    if not isinstance(backend, Backend):
        raise InvalidDeclaration(
            f"backend {name}: {module.__name__} declares no BACKEND, an instance of "
            "exporter.backends.common.declaration.Backend"
        )
    missing = _missing_parts(name, backend)
    if missing:
        raise InvalidDeclaration(f"backend {name}: {'; '.join(missing)}")
    return backend


def schemas() -> dict[str, type[BackendConfig]]:
    return {name: declared(name).schema for name in names()}


def configured(job: JobConfig) -> ConfiguredBackend:
    """The job's backend, bound to its settings, fallback policy and model dtype."""
    return ConfiguredBackend(
        declared(job.backend.name), job.backend, job.fallback, job.model.dtype.value
    )


@dataclasses.dataclass(frozen=True)
class ConfiguredBackend:
    """A backend's declaration with a job's settings: what the stages ask of the backend."""

    declaration: Backend
    config: BackendConfig
    fallback: FallbackConfig
    # The model's dtype (`model.dtype`).
    dtype: str

    @property
    def name(self) -> str:
        return self.declaration.name

    def check_target(self) -> None:
        """Raises ConfigError, before any work, where the backend cannot run on this machine."""
        self.declaration.check(self.config, self.fallback)

    def toolchain(self) -> dict[str, str]:
        return self.declaration.toolchain(self.config)

    @property
    def output(self) -> Output:
        return self.declaration.output(self.config)

    @property
    def makes_runnable(self) -> bool:
        """Whether the backend, as configured, makes an artifact to run (not a report)."""
        return self.output.runtime is not None

    @property
    def half_precision(self) -> str | None:
        """What the backend is known to lose at the model's dtype, if it declares it."""
        return self.declaration.half_precision.get(self.dtype)

    @property
    def group_scales(self) -> str | None:
        """The dtype the backend reads per-group weight scales in, where not the model's."""
        return self.declaration.group_scales

    @property
    def reference_device(self) -> str:
        """Where eager PyTorch runs to measure the error the reference rule scales."""
        return self.declaration.reference_device(self.config)

    def eager_device(self, target: Mapping[str, str]) -> str:
        """Where eager PyTorch runs to be timed beside the artifact, which ran on `target`."""
        return self.declaration.eager_device(self.config, target)

    @property
    def llm_ops(self) -> LlmOps:
        """The ops the model stage builds a static KV cache with for this backend."""
        return self.declaration.llm_ops(self.config)

    def lower(self, exported: Exported, out_dir: Path) -> Artifact:
        """Writes the artifact file into `out_dir`, and partition.json where the backend
        partitions.

        The policy's partitioning settings shape what is lowered; whether `strict` holds is
        judged after, by `check_fallback`."""
        artifact = self.declaration.lower(exported, self.config, self.fallback, out_dir)
        if artifact.partition:
            write_json(out_dir / PARTITION_FILE, artifact.partition.to_json())
        return artifact

    def lowered_in(self, folder: Path) -> Artifact:
        """The artifact that `lower` wrote into `folder` (or a copy of that folder's files)."""
        partition_path = folder / PARTITION_FILE
        partition = (
            PartitionSummary.from_json(json.loads(partition_path.read_text()))
            if partition_path.exists()
            else None
        )
        output = self.output
        return Artifact.at(folder / output.file, output, partition)

    def check_fallback(self, artifact: Artifact) -> None:
        """Raises LoweringFailed where `fallback` forbids what the partitioner left outside."""
        if artifact.partition:
            enforce(artifact.partition, self.fallback, self.declaration.delegate)

    def adopt(self, path: Path) -> Artifact:
        """A pre-built artifact (`artifact=PATH`) to validate as the backend's own output."""
        output = self.output
        expected = Path(output.file).suffix
        if output.runtime is None:
            raise ConfigError(
                f"artifact={path}: backend={self.name} with these settings makes a report, "
                "not an artifact to run."
            )
        if path.suffix != expected:
            raise ConfigError(
                f"artifact={path}: backend={self.name} runs {expected} files, not {path.suffix!r}."
            )
        artifact = Artifact.at(path, output, partition=None)
        if artifact.data_path is None:
            # The config says nothing of a data file, but the runtime loads one that lies beside
            # the file under its name: the weights audit and the bundle must see it too.
            beside = runtimes.data_file_beside(path, output.runtime)
            artifact = dataclasses.replace(artifact, data_path=beside)
        return artifact


def _missing_parts(name: str, backend: Backend) -> list[str]:
    """What the declaration lacks, each said as what it must be."""
    missing = []
    schema = backend.schema
    if not (isinstance(schema, type) and issubclass(schema, BackendConfig)):
        missing.append(f"schema is {schema!r}, not a subclass of BackendConfig")
    else:
        defaults = {f.name: f.default for f in dataclasses.fields(schema)}
        if defaults["name"] != name:
            missing.append(f"schema's name defaults to {defaults['name']!r}, not {name!r}")
        if not all(isinstance(defaults[k], float) for k in ("atol", "rtol")):
            missing.append("schema has no float defaults for atol and rtol")
        if defaults["device"] not in schema.devices:
            missing.append(f"schema's device {defaults['device']!r} is not among its devices")
    if backend.runtime not in runtimes.names():
        missing.append(
            f"runtime {backend.runtime!r} is no loader of runtimes/loaders/ "
            f"({', '.join(runtimes.names())})"
        )
    if not (backend.delegate is None or isinstance(backend.delegate, str)):
        missing.append(f"delegate is {backend.delegate!r}, neither a name nor None")
    if not isinstance(backend.audit, WeightsReader):
        missing.append(
            f"audit is {backend.audit!r}, not a reader of exporter/audit/readers.py "
            "(a WeightsReader of exporter/artifact/)"
        )
    for method in ("output", "lower"):
        if getattr(type(backend), method) is getattr(Backend, method):
            missing.append(f"{type(backend).__name__} does not define {method}()")
    return missing
