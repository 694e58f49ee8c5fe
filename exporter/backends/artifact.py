"""What the lowering stage hands on: the deployable file, its runtime format, its partitioning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exporter.backends.partition import PartitionSummary


@dataclass(frozen=True)
class Artifact:
    path: Path
    # The key `runtimes.load` dispatches on.
    format: str
    # None where the backend runs everything itself, or the artifact came pre-built.
    partition: PartitionSummary | None
