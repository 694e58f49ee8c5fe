"""What one job produced, filled in stage by stage, and how it ended: the input of tracking."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from exporter.backends import Artifact
from exporter.errors import ExporterError
from exporter.export import Diagnosis
from exporter.validate import Report

# MLflow's run status -> the word the `status` tag and the comparison table use for it.
OUTCOMES = {"FINISHED": "passed", "FAILED": "failed", "KILLED": "killed"}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class JobRecord:
    run_dir: Path
    started_ms: int = field(default_factory=now_ms)
    ended_ms: int | None = None
    # Wall seconds per stage that ran, in order: {"export": 1.2, "lower": 30.5, ...}.
    seconds: dict[str, float] = field(default_factory=dict)
    # Why torch.export failed: the job's error, or with export.on_failure=draft, its warning.
    diagnosis: Diagnosis | None = None
    artifact: Artifact | None = None
    report: Report | None = None
    # Per cached stage (export, goldens, lower): whether its work came from the cache.
    cache_hits: dict[str, bool] = field(default_factory=dict)
    error: ExporterError | None = None
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return self.error.exit_code if self.error else 0

    @property
    def status(self) -> str:
        """MLflow's run status for how the job ended."""
        if self.interrupted:
            return "KILLED"
        return "FAILED" if self.error else "FINISHED"

    @property
    def outcome(self) -> str:
        """How the job ended, in the words of its `status` tag and the comparison table."""
        return OUTCOMES[self.status]
