"""One job, stage by stage: config -> model -> export -> lower -> run and validate -> track.

Each stage takes what the previous one returned. A stage's failure becomes the ExporterError of
that stage, whose exit code the job returns; the run dir keeps every file written before it.
Exported programs, goldens and lowered artifacts come from the cache when a job before this one
made them from the same inputs; the run dir gets links to them either way.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from exporter import backends, comparison, config, export, models, tracking, validate
from exporter.backends import Artifact
from exporter.cache import Cache, link_files
from exporter.errors import (
    ConfigError,
    ExporterError,
    ExportFailed,
    LoweringFailed,
    RuntimeFailed,
    ValidationFailed,
)
from exporter.export import Exported
from exporter.files import write_bytes, write_json
from exporter.record import JobRecord, now_ms
from exporter.validate import goldens
from exporter.validate.plan import plan
from runtimes import Loaded
from runtimes import load as load_runtime

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
CONFIG_FILE = "config.yaml"
TRACEBACK_FILE = "traceback.txt"


def run(
    cfg: DictConfig,
    run_dir: Path,
    choices: Mapping[str, str],
    run_name: str,
    parent_run_id: str | None = None,
) -> int:
    """Runs one job and returns its exit code (0 ok, 1 validation failed, 2..5 a stage failed).

    `parent_run_id`: the sweep's MLflow run to nest this job's run under, if any.
    """
    record = JobRecord(run_dir=run_dir)
    store = None
    try:
        mlflow = config.mlflow_of(cfg)
        # Opened before the rest of the config is checked: a job of a sweep with a bad value
        # elsewhere still gets its FAILED run; a bad tracking URI costs no work.
        store = tracking.open_store(mlflow) if mlflow.enabled else None
        job = config.to_job(cfg)
        write_bytes(run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True).encode())
        _run_stages(job, record)
    except ExporterError as error:
        record.error = error
        log.error("[%s] %s", error.stage, error)
        _keep_traceback(error, run_dir)
    except KeyboardInterrupt:
        record.interrupted = True
        log.error("interrupted; the run dir keeps what was written: %s", run_dir)
    record.ended_ms = now_ms()
    groups = comparison.group_choices(choices)
    summary = comparison.JobSummary.of(record, groups)
    summary.write(run_dir)
    comparison.write_plots([summary], [run_name], run_dir)

    if store is not None:
        try:
            params = config.flatten(cfg)
            tracking.log_job(store, record, summary, params, run_name, parent_run_id)
        except ExporterError as error:
            log.error("[%s] %s", error.stage, error)
            return record.exit_code or error.exit_code
    return record.exit_code


def _run_stages(job: config.JobConfig, record: JobRecord) -> None:
    run_dir = record.run_dir
    cache = Cache(Path(job.cache_dir)) if job.cache else None
    with _stage(record, "model", ConfigError):
        backends.check_target(job)
        bundle = models.build(job.model, job.dynamic)
        # The cache key of the exported program; the goldens' and artifact's keys extend it.
        material = _export_material(job)
    if job.artifact:
        artifact = backends.adopt(Path(job.artifact), job)
        log.info("[lower] skipped: validating the given artifact %s", artifact.path)
    else:
        with _stage(record, "export", ExportFailed):
            exported = _export(cache, record, job, bundle, material)
        with _stage(record, "lower", LoweringFailed):
            artifact = _lower(cache, record, job, exported, material)
    record.artifact = artifact
    if artifact.runtime is None:
        log.info("[validate] skipped: %s is a report, with nothing to run", artifact.path.name)
        return

    def load() -> Loaded:
        try:
            return load_runtime(artifact.path, artifact.runtime, artifact.device)
        except Exception as error:
            raise RuntimeFailed(
                f"cannot load {artifact.path} (runtime {artifact.runtime}): "
                f"{type(error).__name__}: {error}"
            ) from error

    with _stage(record, "validate", RuntimeFailed):
        seed = job.validate.seed
        shapes = plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, seed)
        # Goldens are kept in the cache only, never in the run dir: they are not a result, and
        # can be larger than the artifact.
        if cache is None:
            expected = goldens.compute(bundle, shapes, seed)
        else:
            folder, record.cache_hits["goldens"] = cache.fetch(
                "goldens",
                {**material, "shapes": shapes, "seed": seed, "goldens": goldens.VERSION},
                lambda out: goldens.save(goldens.compute(bundle, shapes, seed), out),
            )
            expected = goldens.load(folder)
        report = validate.run(bundle, load, shapes, expected, job.atol, job.rtol)
    record.report = report
    write_json(run_dir / REPORT_FILE, report.to_json())
    log.info("[validate] report (%s):\n%s", run_dir / REPORT_FILE, report.table())
    if not report.passed:
        raise ValidationFailed(report.failure_message())
    log.info("[validate] passed at all %d live shapes", len(report.shapes))


@contextmanager
def _built(
    cache: Cache | None,
    record: JobRecord,
    kind: str,
    material: dict[str, Any],
    build: Callable[[Path], object],
) -> Iterator[Path]:
    """Yields the folder holding the files `build(folder)` writes: the cache's entry for
    `material`, built only if no job built it before, or with the cache off, a folder of its
    own in the run dir, removed on exit. The caller links what it accepts into the run dir."""
    if cache is not None:
        entry, record.cache_hits[kind] = cache.fetch(kind, material, build)
        yield entry
        return
    folder = Path(tempfile.mkdtemp(dir=record.run_dir, prefix=".partial-"))
    try:
        build(folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _export(
    cache: Cache | None,
    record: JobRecord,
    job: config.JobConfig,
    bundle: models.ModelBundle,
    material: dict[str, Any],
) -> Exported:
    """The exported program, linked into the run dir; a failed export leaves its diagnosis
    there (export_report.json / .txt) instead."""

    def build(out: Path) -> None:
        export.run(bundle, job.export.on_failure, out)

    try:
        with _built(cache, record, "export", material, build) as folder:
            link_files(folder, record.run_dir)
    except export.ExportDiagnosed as failure:
        record.diagnosis = failure.diagnosis
        failure.diagnosis.write(record.run_dir)
        raise
    exported = export.load(record.run_dir, bundle)
    record.diagnosis = exported.diagnosis
    return exported


def _lower(
    cache: Cache | None,
    record: JobRecord,
    job: config.JobConfig,
    exported: Exported,
    export_material: dict[str, Any],
) -> Artifact:
    material = {
        **export_material,
        "backend": dataclasses.asdict(job.backend),
        "fallback": job.fallback.partitioning(),
        "toolchain": backends.toolchain(job),
    }
    with _built(
        cache, record, "lower", material, lambda out: backends.lower(exported, job, out)
    ) as folder:
        # Checked before the run dir gets the artifact: a job that breaks the policy leaves none.
        backends.check_fallback(backends.lowered_in(folder, job), job)
        link_files(folder, record.run_dir)
    return backends.lowered_in(record.run_dir, job)


def _export_material(job: config.JobConfig) -> dict[str, Any]:
    """What determines the exported program, and with a seed and shapes, the goldens too."""
    material: dict[str, Any] = {
        "model": dataclasses.asdict(job.model),
        "dynamic": {name: [b.min, b.max, b.mode.value] for name, b in sorted(job.dynamic.items())},
        "on_failure": job.export.on_failure.value,
        "torch": torch.__version__,
    }
    # A checkpoint or a factory's source rewritten in place is another model.
    material["model_files"] = {
        str(path): [path.stat().st_size, path.stat().st_mtime_ns]
        for path in models.source_files(job.model)
    }
    return material


@contextmanager
def _stage(record: JobRecord, name: str, error_type: type[ExporterError]) -> Iterator[None]:
    """Times and announces the stage; an unexpected exception in it becomes the stage's
    ExporterError."""
    log.info("[%s] started", name)
    start = time.perf_counter()
    try:
        yield
    except ExporterError:
        raise
    except Exception as error:
        raise error_type(f"{type(error).__name__}: {error}") from error
    finally:
        record.seconds[name] = time.perf_counter() - start
    log.info("[%s] done in %.1f s", name, record.seconds[name])


def _keep_traceback(error: ExporterError, run_dir: Path) -> None:
    """The user sees the message; the traceback behind it is kept for a bug report."""
    if error.__cause__ is None:
        return
    text = "".join(traceback.format_exception(error.__cause__))
    path = write_bytes(run_dir / TRACEBACK_FILE, text.encode())
    log.error("[%s] the traceback behind this error is in %s", error.stage, path)
