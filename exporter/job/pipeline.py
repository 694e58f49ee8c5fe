"""One job: config -> startup -> model -> export -> goldens -> lower -> bundle -> validate ->
localize -> repair -> benchmark, then its ending (summary, plots, the MLflow run closed).

Runs in the job's worker process (exporter/job/worker.py). The config stage checks what only
the backend's toolchain can judge; then the startup stage opens the job's MLflow run and loads
the stages' libraries, and the stages run (exporter/job/stages.py: which of bundle, localize,
repair and benchmark run depends on the job and its verdict). A stage's failure becomes the
ExporterError of that stage, whose exit code the job returns; the run dir keeps every file
written before it. Whatever ends the job, its record, which keeps what the stages returned, is
concluded: summary, plots, the MLflow run closed with its status, and the lines the job ends
with (exporter/job/verdict.py).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping

from exporter import backends, config
from exporter.errors import ExporterError, disk_full
from exporter.job.ending import conclude, keep_traceback, open_run, start_run
from exporter.job.timing import Notify, stage
from exporter.process import progress, slurm
from exporter.tracking.record import JobContext, JobRecord

log = logging.getLogger(__name__)


def run(
    job: config.JobConfig, params: Mapping[str, str], context: JobContext, notify: Notify
) -> int:
    """Runs one job and returns its exit code (0 passed, 1 validation failed, 2..7 where it
    failed, 128 + the signal that stopped it). `params`: the MLflow run's params, the composed
    config flattened (the typed job has no form for what a user wrote)."""
    record = JobRecord(run_dir=context.run_dir, started_ms=context.started_ms)
    store = run_id = None
    try:
        with stage(record, "config", notify):
            # Resolved once: the stages are handed it.
            backend = backends.configured(job)
            backend.check_target()
        # Seconds of their own (opening a new SQLite store, importing torch): a stage, so that
        # the job's time is all in its stages.
        with stage(record, "startup", notify):
            # The run opens as the work starts: a job stopped by its configuration leaves none.
            if job.mlflow.enabled:
                progress.doing(f"opening the MLflow store {job.mlflow.tracking_uri}")
                # Imported only here: a job with mlflow=off never imports mlflow.
                from exporter.tracking import runs as tracking

                store = tracking.open_store(job.mlflow)
                run_id = record.run_id = start_run(store, params, context, record)
                notify("run_id", run_id)
            # Imported only now: the stages load torch, which a configuration error need not
            # wait for.
            progress.doing("loading torch and the stages' libraries")
            from exporter.job import stages

        stages.run(job, backend, record, notify)
    except Exception as raised:
        # A full disk between stages (report.json once the last stage ran) ends the job as one
        # in a stage does.
        error = disk_full(raised, record.stage or "job") or raised
        if not isinstance(error, ExporterError):
            raise
        record.error = error
        log.error("[%s] %s", error.stage, error)
        keep_traceback(error, record.run_dir)
        if run_id is None and context.parent_run_id:
            # A sweep's comparison and parent run need every job's run, a refused one too.
            store, run_id = open_run(job.mlflow, params, context, record)
    except KeyboardInterrupt:
        record.stopped_by = signal.SIGINT
        record.stop_reason = slurm.stop_reason(signal.SIGINT)
        log.error(
            "[%s] stopped by Ctrl-C; the run dir keeps what was written: %s",
            record.stage,
            record.run_dir,
        )
    return conclude(record, context, store, run_id)
