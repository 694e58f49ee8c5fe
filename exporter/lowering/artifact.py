"""What the lowering stage hands on: the deployable file, the runtime that loads it, the device
it runs on, its partitioning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.lowering.partition import PartitionSummary


@dataclass(frozen=True)
class Output:
    """What a backend writes, as its config asks: the file's name, and how to run it."""

    file: str
    # The module of the `runtimes` package that loads the file; None for a report with nothing
    # to run (a dry run).
    runtime: str | None
    device: str


@dataclass(frozen=True)
class Artifact:
    path: Path
    runtime: str | None
    device: str
    # None where the backend runs everything itself, or the artifact came pre-built.
    partition: PartitionSummary | None

    @classmethod
    def at(cls, path: Path, output: Output, partition: PartitionSummary | None) -> Artifact:
        return cls(path=path, runtime=output.runtime, device=output.device, partition=partition)
