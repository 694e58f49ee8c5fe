"""The stages of a job after its config is checked: model -> export -> goldens -> lower ->
validate -> benchmark, each taking what the ones before returned. They load torch; the job's frame
(exporter/job/pipeline.py) imports them once the config stage has passed, so a configuration error
is answered without loading it.

Exported programs, goldens and lowered artifacts come from the cache when a job before this one
made them from the same inputs (the same config, code and libraries: exporter/cache/keys.py);
the run dir gets links to them either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from exporter import audit, backends, benchmark, config, export, localize, models, validate
from exporter.backends import Artifact
from exporter.cache import keys as cache_keys
from exporter.cache.store import Cache, key_of, link_files
from exporter.errors import RuntimeFailed, ValidationFailed
from exporter.export import Exported
from exporter.files import write_json
from exporter.job.timing import Notify, stage
from exporter.localize import repair
from exporter.process import memory, progress
from exporter.tracking.record import JobRecord
from exporter.validate import goldens
from exporter.validate.plan import plan
from runtimes import Loaded
from runtimes import load as load_runtime
from runtimes.files import PARTIAL_PREFIX
from runtimes.formats import bundle as bundles
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.report import json_safe
from runtimes.verdict.shapes import NEW_INSTANCE, LiveShape, executions, label

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
BUNDLE_DIR = "bundle"


def run(job: config.JobConfig, record: JobRecord, notify: Notify) -> None:
    run_dir = record.run_dir
    cache = Cache(Path(job.cache_dir)) if job.cache else None
    # The libraries are imported and the MLflow run is open: they last as long as the job.
    memory.spare_survivors()
    with stage(record, "model", notify):
        bundle = models.build(job.model, job.dynamic)
        record.weight_bytes = models.weight_bytes(bundle.module)
        model_material = cache_keys.model(job)
        profiles = export.profiles(bundle)
    output_names = bundle.output_names
    if not job.artifact:
        with stage(record, "export", notify):
            export_material = cache_keys.export(job, model_material)
            _export(cache, record, job, bundle, export_material)
    expected = None
    if backends.configured(job).makes_runnable:
        # Before lowering: the oracle and eager's reference run on the module, which then goes,
        # so no stage holds both the model and its exported program.
        with stage(record, "goldens", notify):
            seed = job.validate.seed
            shapes = plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, seed)
            expected, goldens_file = _goldens(cache, record, job, bundle, model_material, shapes)
    # The weights the audit checks the artifact's against: the model's own for a given
    # artifact, the exported program's (as the lower stage loads it) for a lowered one. Kept
    # until the audit, which runs before the artifact is loaded.
    weights = models.weights(bundle.module) if job.artifact else {}
    del bundle
    memory.release_freed()
    memory.spare_survivors()
    if job.artifact:
        artifact = backends.configured(job).adopt(Path(job.artifact))
        log.info("[lower] skipped: validating the given artifact %s", artifact.path)
    else:
        with stage(record, "lower", notify):
            # Loaded here, from program.pt2, with weights of its own.
            progress.doing("loading the exported program")
            exported = export.load(record.run_dir, profiles)
            weights = {**exported.program.state_dict, **exported.program.constants}
            artifact = _lower(cache, record, job, exported, export_material)
        del exported
        memory.release_freed()
        memory.spare_survivors()
    record.artifact = artifact
    if expected is None:
        log.info("[validate] skipped: %s is a report, with nothing to run", artifact.path.name)
        return
    tolerances = validate.Tolerances(
        job.validate.rule.value,
        job.atol,
        job.rtol,
        job.factor,
        job.validate.floor,
        job.validate.half.value,
        job.validate.kl_factor,
        job.validate.top1_slack,
    )
    backend_precision = backends.configured(job).half_precision
    goldens_source = goldens_file or expected
    if job.bundle:
        with stage(record, "bundle", notify):
            record.bundle = _bundle(
                job, record, artifact, goldens_source, output_names, shapes, tolerances
            )
    with stage(record, "validate", notify):
        report = _validated(record, artifact, weights, output_names, shapes, expected, tolerances)
    if _localizes(job.validate.localize, report):
        with stage(record, "localize", notify):
            record.localization = _localize(job, record, report, expected, tolerances, profiles)
        _write_report(record)
        log.info("[localize] %s", "\n".join(record.localization.lines()))
    if not (report.passed and record.weights_audit.passed):
        # Weights that differ are no kernel's doing: no op to keep out.
        keep_out = (
            repair.keep_out(record.localization, artifact.partition, job.fallback)
            if record.weights_audit.passed
            else None
        )
        message = _failure_message(report, record, keep_out, backend_precision)
        if keep_out is None or job.validate.repair is config.RepairMode.off:
            raise ValidationFailed(message)
        log.warning("[validate] %s", message)
        record.repair = repair.Repair(
            keep_out, message, _report_payload(record), record.cache_keys.get("lower")
        )
        # What the search found is the first artifact's; it stays in the repair's record.
        record.localization = None
        with stage(record, "repair", notify):
            log.info("[repair] lowering again with %s", keep_out.override)
            exported = export.load(record.run_dir, profiles)
            weights = {**exported.program.state_dict, **exported.program.constants}
            repaired_job = dataclasses.replace(job, fallback=keep_out.fallback)
            artifact = _lower(cache, record, repaired_job, exported, export_material)
            del exported
            record.artifact = artifact
            if job.bundle:
                record.bundle = _bundle(
                    job, record, artifact, goldens_source, output_names, shapes, tolerances
                )
            report = _validated(
                record, artifact, weights, output_names, shapes, expected, tolerances
            )
        record.repair.passed = report.passed and record.weights_audit.passed
        _write_report(record)
        if not record.repair.passed:
            repaired_failure = _failure_message(report, record, None, backend_precision)
            raise ValidationFailed(
                f"validate.repair=auto lowered again with {keep_out.override}, and that "
                f"artifact fails too: {repaired_failure} The first artifact: {message}"
            )
        log.info(
            "[repair] the artifact lowered again with %s passes; the first one failed: %s",
            keep_out.override,
            message,
        )
    log.info("[validate] passed at all %d live shapes", len(report.shapes))
    if not job.benchmark.enabled:
        return
    with stage(record, "benchmark", notify):
        record.benchmark = benchmark.run(
            shapes,
            lambda shape: expected.cases[label(shape)][0],
            benchmark.Subject(artifact.runtime, artifact.device, _loader(artifact)),
            _eager(run_dir, job, report.target),
            job.benchmark,
        )
    _write_report(record)
    log.info("[benchmark] latency (%s):\n%s", run_dir / REPORT_FILE, record.benchmark.table())


def _loader(artifact: Artifact) -> Callable[[], Loaded]:
    def load() -> Loaded:
        try:
            return load_runtime(artifact.path, artifact.runtime, artifact.device)
        except Exception as error:
            raise RuntimeFailed(
                f"cannot load {artifact.path} (runtime {artifact.runtime}): "
                f"{type(error).__name__}: {error}"
            ) from error

    return load


def _validated(
    record: JobRecord,
    artifact: Artifact,
    weights: dict[str, torch.Tensor],
    output_names: Sequence[str],
    shapes: Sequence[LiveShape],
    expected: stored_goldens.Goldens,
    tolerances: validate.Tolerances,
) -> validate.Report:
    """The artifact's weights audited against `weights` and its outputs validated, into the
    record and report.json. `weights` is emptied once audited: its tensors go before the
    artifact is loaded."""
    record.weights_audit = audit.audit(artifact, weights)
    weights.clear()
    memory.release_freed()
    report = validate.run(output_names, _loader(artifact), shapes, expected, tolerances)
    record.report = report
    _write_report(record)
    log.info("[validate] report (%s):\n%s", record.run_dir / REPORT_FILE, report.table())
    log.info("[validate] %s", "\n".join(record.weights_audit.lines()))
    return report


def _bundle(
    job: config.JobConfig,
    record: JobRecord,
    artifact: Artifact,
    goldens_source: stored_goldens.Goldens | Path,
    output_names: Sequence[str],
    shapes: Sequence[LiveShape],
    tolerances: validate.Tolerances,
) -> bundles.Bundle:
    """bundle/ in the run dir: links to the artifact's files and the goldens (written there
    when the cache is off), and the manifest that runs them on a target as this job will."""
    assert artifact.runtime is not None
    source = {
        "run_id": record.run_id,
        "tracking_uri": job.mlflow.tracking_uri if job.mlflow.enabled else None,
        "experiment": job.mlflow.experiment if job.mlflow.enabled else None,
        "run_dir": str(record.run_dir),
        "host": socket.gethostname(),
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": job.model.name,
        "dtype": job.model.dtype.value,
        "backend": job.backend.name,
        "libraries": bundles.versions(("torch", "executorch", "transformers")),
    }
    written = bundles.write(
        record.run_dir / BUNDLE_DIR,
        artifact.files(),
        goldens_source,
        artifact.runtime,
        artifact.device,
        output_names,
        shapes,
        executions(shapes),
        tolerances,
        source,
    )
    log.info(
        "[bundle] %s: %s (%.1f MB); check it on a target with: python -m runtimes.check %s",
        written.folder,
        ", ".join(written.files),
        written.total_bytes / 1e6,
        written.folder,
    )
    return written


def _failure_message(
    report: validate.Report,
    record: JobRecord,
    keep_out: repair.KeepOut | None = None,
    backend_precision: str | None = None,
) -> str:
    """Validation's message, with what the backend is known to lose at the model's dtype where
    values differ, then the weights that differ, then where the outputs diverge and, where that
    is one op's doing, the override that keeps the op out of the delegate."""
    sentences = [report.failure_message()] if not report.passed else []
    differ = any(o.values_differ for e in report.executions for o in e.outputs)
    if differ and backend_precision:
        sentences.append(backend_precision)
    weights_audit = record.weights_audit
    if weights_audit and not weights_audit.passed:
        changed = [m.parameter for m in weights_audit.mismatched] + [
            c.where for c in weights_audit.corrupted
        ]
        counted = "1 constant" if len(changed) == 1 else f"{len(changed)} constants"
        verb = "differs" if len(changed) == 1 else "differ"
        sentences.append(
            f"The weights audit found {counted} of the artifact that {verb} from the model's "
            f"weights: {', '.join(changed)}."
        )
    if isinstance(record.localization, localize.FirstDivergence):
        found = record.localization
        sentences.append(
            f"The first node that diverges is {found.summary()} in {found.module or 'the model'}"
            f", at {found.source or 'an unknown source line'}."
        )
        if keep_out:
            sentences.append(keep_out.advice())
    elif isinstance(record.localization, localize.NotReproduced):
        sentences.append("Lowering the program again does not reproduce the failure.")
    return " ".join(sentences) + f" ({REPORT_FILE} in the run dir says more.)"


def _write_report(record: JobRecord) -> None:
    """report.json: validation's report, and what later stages found, each in its section."""
    write_json(record.run_dir / REPORT_FILE, json_safe(_report_payload(record)))


def _report_payload(record: JobRecord) -> dict[str, Any]:
    assert record.report is not None
    sections = {
        "weights_audit": record.weights_audit and record.weights_audit.to_json(),
        "first_divergence": record.localization and record.localization.to_json(),
        "benchmark": record.benchmark and record.benchmark.to_json(),
        "bundle": record.bundle
        and {
            "folder": record.bundle.folder.name,
            "bytes": record.bundle.total_bytes,
            "files": dict(record.bundle.files),
        },
        "repair": record.repair and record.repair.to_json(),
    }
    return {**record.report.to_json(), **{k: v for k, v in sections.items() if v}}


def _localizes(mode: config.LocalizeMode, report: validate.Report) -> bool:
    """Whether the job searches for the first diverging node: on failure (auto) where an
    output's values differ (a wrong dtype alone is no divergence), or always."""
    if mode is config.LocalizeMode.always:
        return True
    differ = any(o.values_differ for e in report.executions for o in e.outputs)
    return mode is config.LocalizeMode.auto and differ


def _localize(
    job: config.JobConfig,
    record: JobRecord,
    report: validate.Report,
    expected: stored_goldens.Goldens,
    tolerances: validate.Tolerances,
    profiles: tuple[export.shapes.InputProfile, ...],
) -> localize.Localization:
    """The first node of the job's exported program that diverges at the first execution that
    failed (on a passing job, at its worst), replayed as validation ran it. What stops the
    search is its result's reason: the job's verdict is validation's either way."""
    # The budget counts from here: loading (or exporting) the program is part of the search.
    started = time.perf_counter()
    replay = _replay(report, expected, tolerances)
    names = report.output_names
    # A .partial- folder: what a stopped job's worker leaves of it is removed
    # (exporter/job/worker.py).
    work_dir = Path(tempfile.mkdtemp(dir=record.run_dir, prefix=f"{PARTIAL_PREFIX}localize-"))
    try:
        program = _program(job, record.run_dir, profiles, work_dir)

        def lower(part: ExportedProgram, folder: Path) -> Callable[[], Loaded]:
            # The part is in memory only: its path is where a backend that ships the program
            # itself (eager) saves it.
            exported = Exported(part, folder / export.PROGRAM_FILE, profiles)
            artifact = backends.configured(job).lower(exported, folder)
            return lambda: load_runtime(artifact.path, artifact.runtime, artifact.device)

        def fails(outputs: Sequence[torch.Tensor]) -> bool:
            judged = validate.judge(names, outputs, replay.shape, expected, tolerances)
            return not all(output.within for output in judged)

        lowered_now, full_lowering_seconds = _lowered_now(job, record)
        return localize.localize(
            program.program,
            lower,
            replay,
            fails,
            tolerances,
            work_dir,
            lowered_now=lowered_now,
            budget_seconds=job.validate.localize_seconds,
            full_lowering_seconds=full_lowering_seconds,
            started=started,
        )
    except Exception as error:
        log.info("[localize] stopped", exc_info=True)
        return localize.NotLocalized(f"the search stopped: {type(error).__name__}: {error}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _lowered_now(job: config.JobConfig, record: JobRecord) -> tuple[str, float | None]:
    """Why the artifact judged is what lowering the job's program makes now ("" where that is
    not known: a given artifact), and what lowering the whole program took where this job
    lowered it. A cache entry is as good as a lowering in this run: its key holds the program,
    the backend's settings, toolchain and code, and its files matched their checksums when the
    job took it."""
    if job.artifact:
        return "", None
    if record.cache_hits.get("lower"):
        return (
            "the artifact is the cache's entry for this program, backend, code and libraries, "
            "and its files matched their checksums",
            None,
        )
    return "this job lowered the artifact from this program in this run", record.seconds.get(
        "lower"
    )


def _replay(
    report: validate.Report, expected: stored_goldens.Goldens, tolerances: validate.Tolerances
) -> localize.Replay:
    """Validation's executions up to the first whose values failed, or where none did, up to
    the one with the largest error under the rule."""
    executions = report.executions
    failed = [i for i, e in enumerate(executions) if any(o.values_differ for o in e.outputs)]

    def error(i: int) -> float:
        return max(o.ratio if tolerances.scaled else o.needed_atol for o in executions[i].outputs)

    last = failed[0] if failed else max(range(len(executions)), key=error)
    return localize.Replay(
        tuple(
            (expected.cases[label(e.shape)][0], e.instance == NEW_INSTANCE)
            for e in executions[: last + 1]
        ),
        executions[last].shape,
        diverged=bool(failed),
    )


def _program(
    job: config.JobConfig,
    run_dir: Path,
    profiles: tuple[export.shapes.InputProfile, ...],
    work_dir: Path,
) -> Exported:
    """The job's exported program; a job that validated a given artifact exported none, and
    exports the model now."""
    if (run_dir / export.PROGRAM_FILE).exists():
        return export.load(run_dir, profiles)
    log.info("[localize] exporting the model: the job validated a given artifact")
    bundle = models.build(job.model, job.dynamic)
    return export.run(bundle, job.export.on_failure, work_dir)


def _eager(
    run_dir: Path, job: config.JobConfig, target: Mapping[str, str]
) -> benchmark.Subject | None:
    """Eager PyTorch to time beside the artifact: the job's exported program, on the device
    that matches the artifact's; None where the job validated a given artifact and exported
    nothing."""
    program = run_dir / export.PROGRAM_FILE
    if not program.exists():
        return None
    device = backends.configured(job).eager_device(target)
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
    folder = Path(tempfile.mkdtemp(dir=record.run_dir, prefix=PARTIAL_PREFIX))
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
    backend = backends.configured(job)
    with _built(
        cache, record, "lower", material, lambda out: backend.lower(exported, out)
    ) as folder:
        # Checked before the run dir gets the artifact: a job that breaks the policy leaves none.
        backend.check_fallback(backend.lowered_in(folder))
        link_files(folder, record.run_dir)
    return backend.lowered_in(record.run_dir)


def _goldens(
    cache: Cache | None,
    record: JobRecord,
    job: config.JobConfig,
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    shapes: list[LiveShape],
) -> tuple[stored_goldens.Goldens, Path | None]:
    """The planned inputs, the float64 oracle's outputs for them and eager's error at the model's
    dtype, and the cache's file of them (None with the cache off). Kept in the cache, and
    linked into the run dir only by its bundle: they are not a result, and can be larger than
    the artifact."""
    material = cache_keys.goldens(job, model_material, shapes)
    record.cache_keys["goldens"] = key_of(material)

    def compute() -> stored_goldens.Goldens:
        return goldens.compute(
            bundle, shapes, job.validate.seed, backends.configured(job).reference_device
        )

    if cache is None:
        return compute(), None
    folder, record.cache_hits["goldens"] = cache.fetch(
        "goldens", material, lambda out: stored_goldens.save(compute(), out)
    )
    return stored_goldens.load(folder), folder / stored_goldens.GOLDENS_FILE
