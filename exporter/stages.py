"""The stages of a job after its config is checked: model -> export -> goldens -> lower ->
validate -> benchmark, each taking what the ones before returned. They load torch; the job's frame
(exporter/pipeline.py) imports them once the config stage has passed, so a configuration error
is answered without loading it.

Exported programs, goldens and lowered artifacts come from the cache when a job before this one
made them from the same inputs (the same config, code and libraries: exporter/cache_keys.py);
the run dir gets links to them either way.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from exporter import backends, benchmark, cache_keys, config, export, memory, models, validate
from exporter.backends import Artifact
from exporter.cache import Cache, key_of, link_files
from exporter.errors import RuntimeFailed, ValidationFailed
from exporter.export import Exported
from exporter.files import write_json
from exporter.record import JobRecord, Notify, stage
from exporter.validate import goldens
from exporter.validate.plan import LiveShape, label, plan
from exporter.validate.reference import reference_device
from runtimes import Loaded
from runtimes import load as load_runtime

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"


def run(job: config.JobConfig, record: JobRecord, notify: Notify) -> None:
    run_dir = record.run_dir
    cache = Cache(Path(job.cache_dir)) if job.cache else None
    # The libraries are imported and the MLflow run is open: they last as long as the job.
    memory.spare_survivors()
    with stage(record, "model", notify):
        bundle = models.build(job.model, job.dynamic)
        record.weight_bytes = models.weight_bytes(bundle.module)
        model_material = cache_keys.model(job)
    output_names = bundle.output_names
    if not job.artifact:
        with stage(record, "export", notify):
            export_material = cache_keys.export(job, model_material)
            profiles = export.profiles(bundle)
            _export(cache, record, job, bundle, export_material)
    expected = None
    if backends.makes_runnable(job):
        # Before lowering: the oracle and eager's reference run on the module, which then goes,
        # so no stage holds both the model and its exported program.
        with stage(record, "goldens", notify):
            seed = job.validate.seed
            shapes = plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, seed)
            expected = _goldens(cache, record, job, bundle, model_material, shapes)
    del bundle
    memory.release_freed()
    memory.spare_survivors()
    if job.artifact:
        artifact = backends.adopt(Path(job.artifact), job)
        log.info("[lower] skipped: validating the given artifact %s", artifact.path)
    else:
        with stage(record, "lower", notify):
            # Loaded here, from program.pt2, with weights of its own.
            exported = export.load(record.run_dir, profiles)
            artifact = _lower(cache, record, job, exported, export_material)
        del exported
        memory.release_freed()
        memory.spare_survivors()
    record.artifact = artifact
    if expected is None:
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

    tolerances = validate.Tolerances(
        job.validate.rule.value, job.atol, job.rtol, job.factor, job.validate.floor
    )
    with stage(record, "validate", notify):
        report = validate.run(output_names, load, shapes, expected, tolerances)
    record.report = report
    write_json(run_dir / REPORT_FILE, report.to_json())
    log.info("[validate] report (%s):\n%s", run_dir / REPORT_FILE, report.table())
    if not report.passed:
        raise ValidationFailed(report.failure_message())
    log.info("[validate] passed at all %d live shapes", len(report.shapes))
    if not job.benchmark.enabled:
        return
    with stage(record, "benchmark", notify):
        record.benchmark = benchmark.run(
            shapes,
            lambda shape: expected.cases[label(shape)][0],
            benchmark.Subject(artifact.runtime, artifact.device, load),
            _eager(run_dir, job, report.target),
            job.benchmark,
        )
    write_json(run_dir / REPORT_FILE, {**report.to_json(), "benchmark": record.benchmark.to_json()})
    log.info("[benchmark] latency (%s):\n%s", run_dir / REPORT_FILE, record.benchmark.table())


def _eager(
    run_dir: Path, job: config.JobConfig, target: Mapping[str, str]
) -> benchmark.Subject | None:
    """Eager PyTorch to time beside the artifact: the job's exported program, on the device
    that matches the artifact's; None where the job validated a given artifact and exported
    nothing."""
    program = run_dir / export.PROGRAM_FILE
    if not program.exists():
        return None
    device = benchmark.eager_device(job.backend.device, target)
    return benchmark.Subject("eager", device, lambda: load_runtime(program, "eager", device))


@contextlib.contextmanager
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
    record.cache_keys[kind] = key_of(material)
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
) -> None:
    """Links the exported program (program.pt2) into the run dir; a failed export leaves its
    diagnosis there (export_report.json / .txt) instead."""

    def build(out: Path) -> None:
        export.run(bundle, job.export.on_failure, out)

    try:
        with _built(cache, record, "export", material, build) as folder:
            link_files(folder, record.run_dir)
    except export.ExportDiagnosed as failure:
        record.diagnosis = failure.diagnosis
        failure.diagnosis.write(record.run_dir)
        raise
    record.diagnosis = export.Diagnosis.read(record.run_dir)


def _lower(
    cache: Cache | None,
    record: JobRecord,
    job: config.JobConfig,
    exported: Exported,
    export_material: dict[str, Any],
) -> Artifact:
    material = cache_keys.lower(job, export_material)
    with _built(
        cache, record, "lower", material, lambda out: backends.lower(exported, job, out)
    ) as folder:
        # Checked before the run dir gets the artifact: a job that breaks the policy leaves none.
        backends.check_fallback(backends.lowered_in(folder, job), job)
        link_files(folder, record.run_dir)
    return backends.lowered_in(record.run_dir, job)


def _goldens(
    cache: Cache | None,
    record: JobRecord,
    job: config.JobConfig,
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    shapes: list[LiveShape],
) -> goldens.Goldens:
    """The planned inputs, the float64 oracle's outputs for them and eager's error at the model's
    dtype. Kept in the cache only, never in the run dir: they are not a result, and can be
    larger than the artifact."""
    material = cache_keys.goldens(job, model_material, shapes)
    record.cache_keys["goldens"] = key_of(material)

    def compute() -> goldens.Goldens:
        return goldens.compute(bundle, shapes, job.validate.seed, reference_device(job))

    if cache is None:
        return compute()
    folder, record.cache_hits["goldens"] = cache.fetch(
        "goldens", material, lambda out: goldens.save(compute(), out)
    )
    return goldens.load(folder)
