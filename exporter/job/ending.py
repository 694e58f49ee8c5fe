"""How a job ends: its summary and plots in its run dir, its MLflow run closed with its status,
and the lines it ends with (exporter/job/verdict.py).

A job is concluded by its worker process when the job ends, or by the command's process when
the worker died (exporter/job/worker.py): either way every job ends with a summary and, where
tracking is on, an MLflow run with a final status.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.config import MlflowConfig
from exporter.errors import DiskFull, ExporterError, TrackingFailed
from exporter.files import write_bytes
from exporter.job import verdict as job_verdict
from exporter.tracking import comparison
from exporter.tracking.record import JobContext, JobRecord, now_ms
from runtimes.files import NoRoom

if TYPE_CHECKING:
    from exporter.tracking.runs import Store

log = logging.getLogger(__name__)

TRACEBACK_FILE = "traceback.txt"


def conclude(
    record: JobRecord, context: JobContext, store: Store | None, run_id: str | None
) -> int:
    """Writes the ended job's summary and plots into its run dir, closes its MLflow run and logs
    the job's closing lines; returns the job's exit code, or the tracking failure's where the
    job itself passed. A run dir with no room for them fails a job that had not failed
    (DiskFull); its MLflow run still records how the job ended."""
    record.ended_ms = now_ms()
    choices = comparison.group_choices(context.choices)
    summary = comparison.JobSummary.of(record, choices)
    plots: list[Path] = []
    try:
        summary.write(record.run_dir)
        plots = comparison.write_plots([summary], [context.run_name], record.run_dir)
    except NoRoom as no_room:
        full = DiskFull(no_room, "job")
        # A job that ended for want of room has said so: its summary finding none adds nothing.
        if not isinstance(record.error, DiskFull):
            log.error("[%s] %s", full.stage, full)
        if record.error is None and record.stopped_by is None:
            record.error = full
            summary = comparison.JobSummary.of(record, choices)
            # Where the summary fitted and the plots did not, it says how the job ended now.
            with contextlib.suppress(NoRoom):
                summary.write(record.run_dir)
    exit_code, run_link = record.exit_code, []
    if store is not None and run_id is not None:
        # Imported only here: a job with mlflow=off never imports mlflow.
        from exporter.tracking import runs as tracking

        try:
            tracking.end_run(store, run_id, record, summary)
            run_link = job_verdict.mlflow_run_lines(store.uri, store.experiment_id, run_id)
        except (TrackingFailed, DiskFull) as error:
            log.error("[%s] %s", error.stage, error)
            exit_code = exit_code or error.exit_code
    seconds = (now_ms() - record.started_ms) / 1000
    for line in job_verdict.lines(summary, exit_code, record.run_dir, plots, run_link, seconds):
        log.info(line)
    return exit_code


def start_run(
    store: Store, params: Mapping[str, str], context: JobContext, record: JobRecord
) -> str:
    """Opens the job's MLflow run, RUNNING, with its params (the composed config, flattened:
    exporter/config's `flatten`) and Hydra's choices."""
    from exporter.tracking import runs as tracking

    return tracking.start_run(
        store,
        context.run_name,
        record.started_ms,
        params,
        {**comparison.group_choices(context.choices), tracking.JOB_TAG: context.run_dir.name},
        context.parent_run_id,
    )


def open_run(
    mlflow: MlflowConfig,
    params: Mapping[str, str],
    context: JobContext,
    record: JobRecord,
    run_id: str | None = None,
) -> tuple[Store | None, str | None]:
    """The job's MLflow store and run, the run opened here unless `run_id` names it: for a job
    that ends without its worker having opened it. (None, None) where tracking is off or cannot
    be opened, which is logged: the job's own ending matters more than its record's."""
    from exporter.tracking import runs as tracking

    try:
        if not mlflow.enabled:
            return None, None
        store = tracking.open_store(mlflow)
        return store, run_id or start_run(store, params, context, record)
    except ExporterError as error:
        log.error("[%s] %s", error.stage, error)
        return None, None


def keep_traceback(error: ExporterError, run_dir: Path) -> None:
    """The user sees the message; the traceback behind it is kept for a bug report."""
    if error.__cause__ is None:
        return
    text = "".join(traceback.format_exception(error.__cause__))
    try:
        path = write_bytes(run_dir / TRACEBACK_FILE, text.encode(), "the traceback")
    except NoRoom as no_room:
        lost = DiskFull(no_room, error.stage)
        log.error("[%s] the traceback behind this error is not kept: %s", error.stage, lost)
        return
    log.error("[%s] the traceback behind this error is in %s", error.stage, path)
