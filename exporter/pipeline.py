"""One job, stage by stage: config -> model -> export -> lower -> run and validate -> track.

Each stage takes what the previous one returned. A stage's failure becomes the ExporterError of
that stage, whose exit code the job returns; the run dir keeps every file written before it.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from exporter import backends, config, export, models, tracking, validate
from exporter.errors import (
    ConfigError,
    ExporterError,
    ExportFailed,
    LoweringFailed,
    RuntimeFailed,
    ValidationFailed,
)
from exporter.files import write_bytes, write_json
from exporter.record import JobRecord, now_ms
from exporter.validate.plan import label
from runtimes import Loaded
from runtimes import load as load_runtime

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
PARTITION_FILE = "partition.json"
CONFIG_FILE = "config.yaml"
TRACEBACK_FILE = "traceback.txt"


def run(cfg: DictConfig, run_dir: Path, choices: Mapping[str, str]) -> int:
    """Runs one job and returns its exit code (0 ok, 1 validation failed, 2..5 a stage failed)."""
    record = JobRecord(run_dir=run_dir)
    store = None
    try:
        job = config.to_job(cfg)
        write_bytes(run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True).encode())
        store = tracking.open_store(job.mlflow) if job.mlflow.enabled else None
        _run_stages(job, record)
    except ExporterError as error:
        record.error = error
        log.error("[%s] %s", error.stage, error)
        _keep_traceback(error, run_dir)
    except KeyboardInterrupt:
        record.interrupted = True
        log.error("interrupted; the run dir keeps what was written: %s", run_dir)
    record.ended_ms = now_ms()

    if store is not None:
        try:
            run_name = f"{job.model.name}-{job.backend.name}"
            tracking.log_job(store, record, config.flatten(cfg), choices, run_name)
        except ExporterError as error:
            log.error("[%s] %s", error.stage, error)
            return record.exit_code or error.exit_code
    return record.exit_code


def _run_stages(job: config.JobConfig, record: JobRecord) -> None:
    run_dir = record.run_dir
    with _stage(record, "model", ConfigError):
        bundle = models.build(job.model, job.dynamic)
    if job.artifact:
        artifact = backends.adopt(Path(job.artifact), job)
        log.info("[lower] skipped: validating the given artifact %s", artifact.path)
    else:
        with _stage(record, "export", ExportFailed):
            exported = export.run(bundle, run_dir)
        with _stage(record, "lower", LoweringFailed):
            artifact = backends.lower(exported, job, run_dir)
    record.artifact = artifact
    if artifact.partition:
        write_json(run_dir / PARTITION_FILE, artifact.partition.to_json())

    def load() -> Loaded:
        try:
            return load_runtime(artifact.path, artifact.format)
        except Exception as error:
            raise RuntimeFailed(
                f"cannot load {artifact.path} ({artifact.format}): {type(error).__name__}: {error}"
            ) from error

    with _stage(record, "validate", RuntimeFailed):
        report = validate.run(bundle, load, job.validate, job.atol, job.rtol)
    record.report = report
    write_json(run_dir / REPORT_FILE, report.to_json())
    log.info("[validate] report (%s):\n%s", run_dir / REPORT_FILE, report.table())
    if not report.passed:
        failed = ", ".join(
            f"{label(r.shape)} (max_abs {r.stats['max_abs']:.3g})" for r in report.failures()
        )
        raise ValidationFailed(
            f"{len(report.failures())} of {len(report.shapes)} live shapes differ from eager "
            f"beyond atol={report.atol:g} rtol={report.rtol:g}: {failed}. "
            f"The smallest atol that would pass them all is {report.worst('needed_atol'):.3g}."
        )
    log.info("[validate] passed at all %d live shapes", len(report.shapes))


@contextmanager
def _stage(record: JobRecord, name: str, error_type: type[ExporterError]) -> Iterator[None]:
    """Times the stage; an unexpected exception in it becomes the stage's ExporterError."""
    start = time.perf_counter()
    try:
        yield
    except ExporterError:
        raise
    except Exception as error:
        raise error_type(f"{type(error).__name__}: {error}") from error
    finally:
        record.seconds[name] = time.perf_counter() - start


def _keep_traceback(error: ExporterError, run_dir: Path) -> None:
    """The user sees the message; the traceback behind it is kept for a bug report."""
    if error.__cause__ is None:
        return
    text = "".join(traceback.format_exception(error.__cause__))
    path = write_bytes(run_dir / TRACEBACK_FILE, text.encode())
    log.error("[%s] the traceback behind this error is in %s", error.stage, path)
