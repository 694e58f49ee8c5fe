"""The localize stage as a job runs it: whether it searches, and the search for the first node
of the job's exported program that diverges, replayed as validation ran the artifact."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.export import ExportedProgram

from exporter import config, export, localize, models, quantize, validate
from exporter.backends import ConfiguredBackend
from exporter.export import Exported
from exporter.job.values import Expected, ProgramFile
from exporter.tracking.record import CacheUse, JobRecord
from runtimes import Loaded
from runtimes import load as load_runtime
from runtimes.files import PARTIAL_PREFIX
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.sessions import calls_up_to
from runtimes.verdict.shapes import NEW_INSTANCE, label

log = logging.getLogger(__name__)


def searches(mode: config.LocalizeMode, report: validate.Report) -> bool:
    """Whether the job searches for the first diverging node: on failure (auto) where an
    output's values differ (a wrong dtype alone is no divergence), or always."""
    if mode is config.LocalizeMode.always:
        return True
    differ = any(o.values_differ for e in report.executions for o in e.outputs)
    return mode is config.LocalizeMode.auto and differ


def localized(
    job: config.JobConfig,
    backend: ConfiguredBackend,
    program: ProgramFile | None,
    report: validate.Report,
    expected: Expected,
    record: JobRecord,
) -> localize.Localization:
    """The first node of the job's exported program that diverges at the first execution that
    failed (on a passing job, at its worst), replayed as validation ran it; `record` says
    where the job writes and how its artifact was lowered. What stops the search is its
    result's reason: the job's verdict is validation's either way."""
    if any("encoded" in session for session in expected.goldens.sessions):
        return localize.NotLocalized(
            "not searched: the model's sessions start with its encode method, which the search's "
            "cut programs do not carry (a cut of the decoder alone would attend to no clip)"
        )
    # The budget counts from here: loading (or exporting) the program is part of the search.
    started = time.perf_counter()
    why_now, lowering_seconds = _lowered_now(job, record.cache, record.seconds.get("lower"))
    tolerances = expected.tolerances
    replay = _replay(report, expected.goldens, tolerances)
    names = report.output_names
    # A .partial- folder: what a stopped job's worker leaves of it is removed
    # (exporter/job/worker.py).
    work_dir = Path(tempfile.mkdtemp(dir=record.run_dir, prefix=f"{PARTIAL_PREFIX}localize-"))
    try:
        exported = program.load() if program else _export_now(job, backend, work_dir)

        def lower(part: ExportedProgram, folder: Path) -> Callable[[], Loaded]:
            # The part is in memory only: its path is where a backend that ships the program
            # itself (eager) saves it.
            part_program = Exported(part, folder / export.PROGRAM_FILE, exported.inputs)
            artifact = backend.lower(part_program, folder)
            return lambda: load_runtime(artifact.path, artifact.runtime, artifact.device)

        def fails(outputs: Sequence[torch.Tensor]) -> bool:
            judged = validate.judge(names, outputs, replay.shape, expected.goldens, tolerances)
            return not all(output.within for output in judged)

        return localize.localize(
            exported.program,
            lower,
            replay,
            fails,
            tolerances,
            work_dir,
            lowered_now=why_now,
            budget_seconds=job.validate.localize_seconds,
            full_lowering_seconds=lowering_seconds,
            started=started,
        )
    except Exception as error:
        log.info("[localize] stopped", exc_info=True)
        return localize.NotLocalized(f"the search stopped: {type(error).__name__}: {error}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _lowered_now(
    job: config.JobConfig, cache: CacheUse, lower_seconds: float | None
) -> tuple[str, float | None]:
    """Why the artifact judged is what lowering the job's program makes now ("" where that is
    not known: a given artifact), and what lowering the whole program took where this job
    lowered it. A cache entry is as good as a lowering in this run: its key holds the program,
    the backend's settings, toolchain and code, and its files matched their checksums when the
    job took it."""
    if job.artifact:
        return "", None
    if cache.hits.get("lower"):
        return (
            "the artifact is the cache's entry for this program, backend, code and libraries, "
            "and its files matched their checksums",
            None,
        )
    return "this job lowered the artifact from this program in this run", lower_seconds


def _replay(
    report: validate.Report, expected: stored_goldens.Goldens, tolerances: validate.Tolerances
) -> localize.Replay:
    """Validation's executions up to the first whose values failed, or where none did, up to
    the one with the largest error under the rule; for a model with a KV cache, every call of
    the sessions up to that step."""
    executions = report.executions
    failed = [i for i, e in enumerate(executions) if any(o.values_differ for o in e.outputs)]

    def error(i: int) -> float:
        return max(o.ratio if tolerances.scaled else o.needed_atol for o in executions[i].outputs)

    last = failed[0] if failed else max(range(len(executions)), key=error)
    shape = executions[last].shape
    if expected.sessions:
        # One instance took every call, as validation ran them.
        calls = calls_up_to(expected.sessions, shape)
        return localize.Replay(
            tuple((call, i == 0) for i, call in enumerate(calls)), shape, bool(failed)
        )
    return localize.Replay(
        tuple(
            (expected.cases[label(e.shape)][0], e.instance == NEW_INSTANCE)
            for e in executions[: last + 1]
        ),
        shape,
        diverged=bool(failed),
    )


def _export_now(job: config.JobConfig, backend: ConfiguredBackend, work_dir: Path) -> Exported:
    """A job that validated a given artifact exported no program: the search exports the
    model now, quantized as the job's was, as the backend's job would."""
    log.info("[localize] exporting the model: the job validated a given artifact")
    bundle = models.build(job.model, job.dynamic, backend.llm_ops)
    if job.quantize.enabled:
        bundle = quantize.quantized(
            bundle, job.quantize, backend.group_scales, job.backend.int4_weight_packed
        )
    return export.run(bundle, job.export, work_dir)
