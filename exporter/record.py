"""What one job produced, filled in stage by stage (`stage` times and announces each), how it
ended, and its ending: the summary in its run dir and the close of its MLflow run.

A job's record is concluded by its worker process when the job ends, or by the command's
process when the worker died (exporter/job_process.py): either way every job ends with a
summary and, where tracking is on, an MLflow run with a final status.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from exporter import config, interrupts, memory, progress
from exporter.errors import STAGE_ERRORS, ExporterError, TrackingFailed
from exporter.files import write_bytes

if TYPE_CHECKING:
    from exporter.audit import WeightsAudit
    from exporter.backends import Artifact
    from exporter.benchmark import Benchmark
    from exporter.export import Diagnosis
    from exporter.localize import Localization
    from exporter.repair import Repair
    from exporter.tracking import Store
    from exporter.validate import Report
    from runtimes.bundle import Bundle

log = logging.getLogger(__name__)

TRACEBACK_FILE = "traceback.txt"

# Tells the command's process how far the job got: ("run_id", id), ("stage", name).
Notify = Callable[[str, str], None]
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
class JobRecord:
    run_dir: Path
    started_ms: int = field(default_factory=now_ms)
    ended_ms: int | None = None
    # The stage running, or the last one that ran.
    stage: str | None = None
    # Wall seconds per stage that ran, in order: {"export": 1.2, "lower": 30.5, ...}.
    seconds: dict[str, float] = field(default_factory=dict)
    # Peak RSS in bytes of the worker process per stage that ran (exporter/memory.py: its own
    # peak on Linux, the process's so far elsewhere, as `peak_rss_scope` says), and over the job
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
    # Per cached stage (export, goldens, lower): its cache key, and whether its work came from
    # the cache.
    cache_keys: dict[str, str] = field(default_factory=dict)
    cache_hits: dict[str, bool] = field(default_factory=dict)
    error: ExporterError | None = None
    # The signal that stopped the job (SIGINT, SIGTERM), if one did, and why it came where that
    # is known (Slurm's time limit).
    stopped_by: int | None = None
    stop_reason: str | None = None

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


def conclude(
    record: JobRecord, context: JobContext, store: Store | None, run_id: str | None
) -> int:
    """Writes the ended job's summary and plots into its run dir, closes its MLflow run and logs
    the job's closing lines; returns the job's exit code, or the tracking failure's where the
    job itself passed."""
    # Imported here: the comparison reads JobRecord from this module.
    from exporter import comparison, job_verdict

    record.ended_ms = now_ms()
    summary = comparison.JobSummary.of(record, comparison.group_choices(context.choices))
    summary.write(record.run_dir)
    plots = comparison.write_plots([summary], [context.run_name], record.run_dir)
    exit_code, run_link = record.exit_code, []
    if store is not None and run_id is not None:
        from exporter import tracking

        try:
            tracking.end_run(store, run_id, record, summary)
            run_link = job_verdict.mlflow_run_lines(store.uri, store.experiment_id, run_id)
        except TrackingFailed as error:
            log.error("[%s] %s", error.stage, error)
            exit_code = exit_code or error.exit_code
    seconds = (now_ms() - record.started_ms) / 1000
    for line in job_verdict.lines(summary, exit_code, record.run_dir, plots, run_link, seconds):
        log.info(line)
    return exit_code


def start_run(store: Store, cfg: DictConfig, context: JobContext, record: JobRecord) -> str:
    """Opens the job's MLflow run, RUNNING, with its params and Hydra's choices."""
    from exporter import comparison, tracking

    return tracking.start_run(
        store,
        context.run_name,
        record.started_ms,
        config.flatten(cfg),
        {**comparison.group_choices(context.choices), tracking.JOB_TAG: context.run_dir.name},
        context.parent_run_id,
    )


def open_run(
    cfg: DictConfig, context: JobContext, record: JobRecord, run_id: str | None = None
) -> tuple[Store | None, str | None]:
    """The job's MLflow store and run, the run opened here unless `run_id` names it: for a job
    that ends without its worker having opened it. (None, None) where tracking is off or cannot
    be opened, which is logged: the job's own ending matters more than its record's."""
    from exporter import tracking

    try:
        mlflow = config.mlflow_of(cfg)
        if not mlflow.enabled:
            return None, None
        store = tracking.open_store(mlflow)
        return store, run_id or start_run(store, cfg, context, record)
    except ExporterError as error:
        log.error("[%s] %s", error.stage, error)
        return None, None


def keep_traceback(error: ExporterError, run_dir: Path) -> None:
    """The user sees the message; the traceback behind it is kept for a bug report."""
    if error.__cause__ is None:
        return
    text = "".join(traceback.format_exception(error.__cause__))
    path = write_bytes(run_dir / TRACEBACK_FILE, text.encode())
    log.error("[%s] the traceback behind this error is in %s", error.stage, path)


@contextlib.contextmanager
def stage(record: JobRecord, name: str, notify: Notify) -> Iterator[None]:
    """Times and announces the stage, says how long it has run while it runs long
    (exporter/progress.py) and measures its peak RSS; an unexpected exception in it
    becomes the stage's ExporterError. Its start and end are the points where a requested stop
    happens."""
    interrupts.check()
    record.stage = name
    notify("stage", name)
    log.info("[%s] started", name)
    # What ran since the last stage (opening the MLflow run) counts for the job's peak.
    _note_job_peak(record, memory.reset_peak())
    start = time.perf_counter()
    try:
        with progress.reported(name, progress.PERIOD_S):
            yield
    except ExporterError:
        raise
    except Exception as error:
        raise STAGE_ERRORS[name](f"{type(error).__name__}: {error}") from error
    finally:
        record.seconds[name] = time.perf_counter() - start
        record.peak_rss_bytes[name] = memory.peak_rss()
        record.peak_rss_scope = memory.scope()
        _note_job_peak(record, record.peak_rss_bytes[name])
    log.info(
        "[%s] done in %.1f s, peak RSS %.2f GB",
        name,
        record.seconds[name],
        record.peak_rss_bytes[name] / memory.GB,
    )
    interrupts.check()


def _note_job_peak(record: JobRecord, peak: int) -> None:
    record.job_peak_rss_bytes = max(record.job_peak_rss_bytes or 0, peak)
