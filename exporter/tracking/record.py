"""What one job produced and how it ended: the record that its summary, its MLflow run and the
sweep's comparison are made from. The job's stages (exporter/job/stages.py) keep each value in it
as it comes, so a job that fails or is stopped at a stage still ends with what the stages before
it made. Data only, no torch: the job's frame holds one before the stages are imported. How a job
ends is exporter/job/ending.py's."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.errors import ExporterError

if TYPE_CHECKING:
    from exporter.artifact import Artifact
    from exporter.audit import WeightsAudit
    from exporter.benchmark import Benchmark
    from exporter.export import Diagnosis
    from exporter.localize import Localization
    from exporter.localize.repair import Repair
    from exporter.quantize import Quantization
    from exporter.quantize.attribution import Attribution
    from exporter.quantize.verdict import Quality
    from exporter.validate import Report
    from runtimes.formats.bundle import Bundle

# MLflow's run status -> the word the `status` tag and the comparison table use for it.
OUTCOMES = {"FINISHED": "passed", "FAILED": "failed", "KILLED": "killed", "RUNNING": "running"}


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class JobContext:
    """Where a job runs and under which names: Hydra's run dir and group choices, the MLflow
    run's name and the sweep's parent run to nest it under."""

    run_dir: Path
    choices: Mapping[str, str]
    run_name: str
    parent_run_id: str | None = None
    # When the command composed the job: its total time counts from here.
    started_ms: int = field(default_factory=now_ms)


@dataclass
class CacheUse:
    """Per cached stage (plan, export, goldens, lower): its cache key, noted before its work
    starts, and whether its work came from the cache, noted once the cache answered (absent with
    the cache off)."""

    keys: dict[str, str] = field(default_factory=dict)
    hits: dict[str, bool] = field(default_factory=dict)


@dataclass
class JobRecord:
    run_dir: Path
    started_ms: int = field(default_factory=now_ms)
    ended_ms: int | None = None
    # The stage running, or the last one that ran.
    stage: str | None = None
    # Wall seconds per stage that ran, in order: {"export": 1.2, "lower": 30.5, ...}.
    seconds: dict[str, float] = field(default_factory=dict)
    # Peak RSS in bytes of the worker process per stage that ran (exporter/process/memory.py: its
    # own peak on Linux, the process's so far elsewhere, as `peak_rss_scope` says), and over the job
    # from its worker's start to its last stage's end. Host memory only: with
    # backend.device=cuda the GPU's memory is not in it.
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    job_peak_rss_bytes: int | None = None
    peak_rss_scope: str | None = None
    # The model's parameters and buffers, each storage counted once (the model stage's).
    weight_bytes: int | None = None
    # Why torch.export failed: the job's error, or with export.on_failure=draft, its warning.
    diagnosis: Diagnosis | None = None
    # The job's MLflow run where tracking is on: its bundle names it, so a target's check of
    # the bundle can be attached to it.
    run_id: str | None = None
    artifact: Artifact | None = None
    # What the target's check needs (bundle=on and an artifact to run).
    bundle: Bundle | None = None
    report: Report | None = None
    # The artifact's constants checked against the model's weights.
    weights_audit: WeightsAudit | None = None
    # Where the artifact first diverges (validate.localize), or why that is not known.
    localization: Localization | None = None
    # validate.repair=auto at work: the first artifact's failure and the override it was
    # lowered again with (the record's artifact, report and audit are then the repaired one's).
    repair: Repair | None = None
    benchmark: Benchmark | None = None
    # A quantized model: what was quantized (with quantize=auto, the plan), what quantization
    # costs, judged apart from fidelity, and which layers cost the most (quantize.attribution).
    quantization: Quantization | None = None
    quality: Quality | None = None
    attribution: Attribution | None = None
    cache: CacheUse = field(default_factory=CacheUse)
    error: ExporterError | None = None
    # The signal that stopped the job (SIGINT, SIGTERM), if one did, and why it came where that
    # is known (Slurm's time limit).
    stopped_by: int | None = None
    stop_reason: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the artifact validated: its outputs within the rule and its constants the
        model's."""
        audit, report = self.weights_audit, self.report
        return audit is not None and audit.passed and report is not None and report.passed

    @property
    def exit_code(self) -> int:
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return self.error.exit_code if self.error else 0

    @property
    def status(self) -> str:
        """MLflow's run status for how the job ended."""
        if self.stopped_by is not None:
            return "KILLED"
        return "FAILED" if self.error else "FINISHED"

    @property
    def outcome(self) -> str:
        """How the job ended, in the words of its `status` tag and the comparison table."""
        return OUTCOMES[self.status]

    @property
    def failed_stage(self) -> str | None:
        if self.error:
            return self.error.stage
        return self.stage if self.stopped_by is not None else None
