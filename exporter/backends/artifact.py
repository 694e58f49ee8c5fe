"""What the lowering stage hands on: the deployable file, its runtime format, the device it runs
on, its partitioning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.backends.partition import PartitionSummary
from exporter.config import Device


@dataclass(frozen=True)
class Output:
    """What a backend writes, as its config asks: the file's name, and how to run it."""

    file: str
    # The key `runtimes.load` dispatches on; None for a report with nothing to run (a dry run).
    format: str | None
    device: Device


@dataclass(frozen=True)
class Artifact:
    path: Path
    format: str | None
    device: Device
    # None where the backend runs everything itself, or the artifact came pre-built.
    partition: PartitionSummary | None

    @classmethod
    def at(cls, path: Path, output: Output, partition: PartitionSummary | None) -> Artifact:
        return cls(path=path, format=output.format, device=output.device, partition=partition)
