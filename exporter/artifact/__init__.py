"""What the lowering stage hands on: the deployable file (and the data file that travels with
it), the runtime that loads it, the device it runs on, the weights audit's reader of it, and its
partitioning (exporter/artifact/partition.py).

Later stages (the bundle, the weights audit, validation, localization, the benchmark) and the
job's record take the artifact as a value, so it stands below every stage: none of them, and
none of the backends that make it, imports another stage to name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from exporter.artifact.partition import PartitionSummary


class WeightsReader(Enum):
    """Which reader of the weights audit reads an artifact's weights: one per artifact format,
    each a function of exporter/audit/readers.py by that name. A backend declares its reader by
    this name, so the backends import nothing of the audit, which runs after them."""

    # A .pte's constants, named data and .ptd (executorch, webgpu).
    pte = "pte"
    # An AOTInductor package's pickled weights (aoti).
    aoti_package = "aoti_package"
    # A torch.export program's state dict and constants (eager).
    exported_program = "exported_program"
    # Nothing: only TensorRT reads its engines (tensorrt).
    tensorrt_engine = "tensorrt_engine"


@dataclass(frozen=True)
class Output:
    """What a backend writes, as its config asks: the file's name, and how to run it."""

    file: str
    # The module of the `runtimes` package that loads the file; None for a report with nothing
    # to run (a dry run).
    runtime: str | None
    device: str
    # How the weights audit reads the file's weights (the backend's declared reader).
    audit: WeightsReader
    # A file of the artifact's data (weights) that must lie beside `file`, where the runtime
    # loads it from (ExecuTorch's model.ptd); None where `file` holds everything. A model without
    # weights may leave it unwritten.
    data_file: str | None = None


@dataclass(frozen=True)
class Artifact:
    path: Path
    runtime: str | None
    device: str
    # The weights audit's reader of `path` (Output.audit).
    audit: WeightsReader
    # None where the backend runs everything itself, or the artifact came pre-built.
    partition: PartitionSummary | None
    # The data file beside `path`, named after it as the runtime looks for it (a pre-built
    # weights.pte has weights.ptd); it may not exist (see `Output.data_file`).
    data_path: Path | None = None

    @classmethod
    def at(cls, path: Path, output: Output, partition: PartitionSummary | None) -> Artifact:
        data_path = path.with_suffix(Path(output.data_file).suffix) if output.data_file else None
        return cls(
            path=path,
            runtime=output.runtime,
            device=output.device,
            audit=output.audit,
            partition=partition,
            data_path=data_path,
        )

    def files(self) -> tuple[Path, ...]:
        """The files that deploy together: the artifact and its data file where it has one."""
        data = (self.data_path,) if self.data_path and self.data_path.exists() else ()
        return (self.path, *data)

    def file_bytes(self) -> int:
        """The bytes of the files that deploy together."""
        return sum(path.stat().st_size for path in self.files())
