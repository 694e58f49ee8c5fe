"""The stages of a job after its config is checked, in the order they run: model -> export ->
goldens -> lower -> bundle -> validate -> localize -> repair -> benchmark. Each is a function of
the values the ones before returned (the model's bundle, the exported program's file, the
goldens, the lowered artifact, the report), and `run` is the sequence that calls them and keeps
their values for the job's record (exporter/job/produced.py). They load torch; the job's frame
(exporter/job/pipeline.py) imports them once the config stage has passed, so a configuration error
is answered without loading it.

Exported programs, goldens and lowered artifacts come from the cache when a job before this one
made them from the same inputs (the same config, code and libraries: exporter/cache/keys.py);
the run dir gets links to them either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from exporter import audit, benchmark, config, export, localize, models, quantize, validate
from exporter.artifact import Artifact
from exporter.backends import ConfiguredBackend
from exporter.cache import keys as cache_keys
from exporter.cache.store import Cache, key_of, link_files
from exporter.config import hf_checkpoint
from exporter.errors import ConfigError, QualityFailed, RuntimeFailed, ValidationFailed
from exporter.export import Exported
from exporter.files import write_json
from exporter.job.produced import CacheUse, Produced
from exporter.job.timing import Notify, stage
from exporter.localize import repair
from exporter.process import memory, progress
from exporter.quantize import attribution, quality
from exporter.quantize import verdict as quality_verdict
from exporter.tracking.record import JobRecord
from exporter.validate import goldens, sessions, text
from exporter.validate.plan import plan
from runtimes import Loaded
from runtimes import load as load_runtime
from runtimes.files import PARTIAL_PREFIX, room_checked
from runtimes.formats import bundle as bundles
from runtimes.formats.pte_file import TensorValue, input_sizes
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.report import json_safe
from runtimes.verdict.sessions import calls_up_to, outline
from runtimes.verdict.sessions import judged as judged_steps
from runtimes.verdict.shapes import NEW_INSTANCE, SAME_INSTANCE, LiveShape, executions, label

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"
PLAN_FILE = "plan.json"
BUNDLE_DIR = "bundle"


@dataclass(frozen=True)
class ProgramFile:
    """The export stage's value: the folder holding program.pt2 (the cache's entry, or with the
    cache off the run dir), what loading it needs of the model, the cache material that made it
    (lowering's key builds on it), and why torch.export failed where the job went on with
    draft_export's program. Stages load the program from it once the model has gone, with
    weights of its own: no stage holds both."""

    folder: Path
    profiles: tuple[export.shapes.InputProfile, ...]
    material: dict[str, Any]
    diagnosis: export.Diagnosis | None
    # What an LLM runner reads of the artifact, which lowering writes into it.
    runner_metadata: models.RunnerMetadata
    # The program's buffers that it writes as it runs (a KV cache), which the weights audit
    # skips.
    state: frozenset[str] = frozenset()

    @property
    def path(self) -> Path:
        return self.folder / export.PROGRAM_FILE

    def load(self) -> Exported:
        progress.doing("loading the exported program")
        return export.load(self.folder, self.profiles, self.runner_metadata)


@dataclass(frozen=True)
class Expected:
    """The goldens stage's value, what every artifact of the job is judged against: the model's
    output names, the live shapes, the goldens (the planned inputs, the float64 oracle's outputs
    and eager's error at the model's dtype) with the cache's file of them (None with the cache
    off), and the job's rule."""

    output_names: tuple[str, ...]
    shapes: list[LiveShape]
    goldens: stored_goldens.Goldens
    file: Path | None
    tolerances: validate.Tolerances

    @property
    def source(self) -> stored_goldens.Goldens | Path:
        """What a bundle takes the goldens from: the cache's file where there is one."""
        return self.file or self.goldens


@dataclass(frozen=True)
class Lowered:
    """The lower stage's value: the artifact in the run dir, and the weights the audit checks
    its constants against (the exported program's as the stage loaded it, or the model's for a
    given artifact), emptied by the audit, which runs before the artifact is loaded; `state`:
    those of them that the program writes as it runs (a KV cache), which the audit skips."""

    artifact: Artifact
    weights: dict[str, torch.Tensor]
    state: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _Store:
    """Where the cached stages' files come from: the cache (None where it is off), the run dir
    (which gets links to them, and with the cache off their staging folders), and the ledger of
    cache keys and hits that the job's record gets."""

    cache: Cache | None
    run_dir: Path
    use: CacheUse

    @contextlib.contextmanager
    def built(
        self, kind: str, material: dict[str, Any], build: Callable[[Path], object]
    ) -> Iterator[Path]:
        """Yields the folder holding the files `build(folder)` writes: the cache's entry for
        `material`, built only if no job built it before, or with the cache off, a folder of
        its own in the run dir, removed on exit. The caller links what it accepts into the run
        dir."""
        self.use.keys[kind] = key_of(material)
        if self.cache is not None:
            entry, self.use.hits[kind] = self.cache.fetch(kind, material, build)
            yield entry
            return
        folder = Path(tempfile.mkdtemp(dir=self.run_dir, prefix=PARTIAL_PREFIX))
        try:
            with room_checked(f"the {kind} stage's files", folder):
                build(folder)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def run(
    job: config.JobConfig,
    backend: ConfiguredBackend,
    produced: Produced,
    record: JobRecord,
    notify: Notify,
) -> None:
    """The stages in the order they run, each handed the values of the ones before, each value
    kept in `produced` as it comes; `backend` is the job's, resolved once by the frame. `record`
    is the frame's: the stages' timings.

    report.json is written from the values: when validation's verdict is known, and once more
    at the end where the stages after it (localize, repair, benchmark) added to it, so that a
    job that one of them crashes or stops keeps the verdict."""
    cache = Cache(Path(job.cache_dir)) if job.cache else None
    sequence = _Sequence(
        job, backend, produced, record, notify, _Store(cache, record.run_dir, produced.cache)
    )
    try:
        program, expected, lowered = sequence.made()
        if expected is None:
            log.info(
                "[validate] skipped: %s is a report, with nothing to run", lowered.artifact.path
            )
            return
        lowered = sequence.judged(program, expected, lowered)
        if job.benchmark.enabled:
            sequence.benchmarked(program, expected, lowered)
    finally:
        if produced.report and (produced.localization or produced.repair or produced.benchmark):
            _write_report(record.run_dir, produced)


@dataclass(frozen=True)
class _Sequence:
    """What every stage of the sequence shares: the job, its backend, the values kept so far,
    the frame's record (the stages' timings) and how it is told of each stage, and the cache."""

    job: config.JobConfig
    backend: ConfiguredBackend
    produced: Produced
    record: JobRecord
    notify: Notify
    store: _Store

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        return stage(self.record, name, self.notify)

    def made(self) -> tuple[ProgramFile | None, Expected | None, Lowered]:
        """model -> export -> goldens -> lower: the exported program (None for a given
        artifact), what artifacts are judged against (None where the backend makes a report),
        and the artifact."""
        job, produced = self.job, self.produced
        # The libraries are imported and the MLflow run is open: they last as long as the job.
        memory.spare_survivors()
        with self.timed("model"):
            bundle = models.build(job.model, job.dynamic, self.backend.llm_ops)
            if job.artifact:
                bundle = _bounded_by_artifact(bundle, job, self.backend.llm_ops)
            produced.weight_bytes = models.weight_bytes(bundle.module)
            model_material = cache_keys.model(job)
        if job.quantize.enabled:
            with self.timed("quantize"):
                scales = self.backend.group_scales
                plan = None
                if job.quantize.scheme is config.QuantScheme("auto"):
                    bundle, plan = _planned(bundle, model_material, job, scales, self.store)
                else:
                    bundle = quantize.quantized(bundle, job.quantize, scales)
                produced.quantization = quantize.summary(bundle.module, job.quantize, scales, plan)
                log.info("[quantize] %s", produced.quantization.line())
        program = None
        if not job.artifact:
            with self.timed("export"):
                try:
                    program = _export(bundle, model_material, job, self.store)
                except export.ExportDiagnosed as failure:
                    produced.diagnosis = failure.diagnosis
                    raise
                produced.diagnosis = program.diagnosis
        # A given artifact's constants are audited against the model's own weights (a KV
        # cache's buffers, which the goldens' sessions fill, are state the audit skips).
        weights = {} if program else models.weights(bundle.module)
        expected = None
        if self.backend.makes_runnable:
            # Before lowering: the oracle and eager's reference run on the module, which then
            # goes, so no stage holds both the model and its exported program.
            with self.timed("goldens"):
                device = self.backend.reference_device
                expected = _goldens(bundle, model_material, job, device, self.store)
            if job.quantize.attribution and bundle.unquantized is not None:
                self.attributed(bundle.unquantized, expected)
        state = _cache_buffers(bundle)
        del bundle
        memory.release_freed()
        memory.spare_survivors()
        if program is None:
            lowered = Lowered(self.backend.adopt(Path(job.artifact)), weights, state)
            log.info("[lower] skipped: validating the given artifact %s", lowered.artifact.path)
        else:
            with self.timed("lower"):
                lowered = _lower(program, job, self.backend, self.store)
            memory.release_freed()
            memory.spare_survivors()
        produced.artifact = lowered.artifact
        return program, expected, lowered

    def attributed(self, float_bundle: models.ModelBundle, expected: Expected) -> None:
        """quantize.attribution: the quality each layer costs, quantized alone, on the goldens'
        inputs; ranked by what it costs the next-token predictions, which a model without
        logits has none of."""
        if True not in expected.goldens.logits:
            log.info("[attribution] skipped: the model has no next-token logits to rank layers by")
            return
        with self.timed("attribution"):
            run = attribution.on_quality_rows(float_bundle, expected.goldens)
            found = attribution.attribute(float_bundle.module, run, self.job.quantize)
        self.produced.attribution = found
        log.info("[attribution] %s", "\n".join(found.lines()))

    def judged(self, program: ProgramFile | None, expected: Expected, lowered: Lowered) -> Lowered:
        """bundle -> validate -> localize -> repair: the artifact that passed (the repaired one
        where the repair lowered again); ValidationFailed where none did."""
        job, backend, produced, run_dir = self.job, self.backend, self.produced, self.record.run_dir
        if job.bundle:
            with self.timed("bundle"):
                produced.bundle = _bundle(job, self.record, lowered.artifact, expected)
        with self.timed("validate"):
            self.validated(lowered, expected)
            _write_report(run_dir, produced)
        assert produced.report is not None
        if _localizes(job.validate.localize, produced.report):
            with self.timed("localize"):
                lower_seconds = self.record.seconds.get("lower")
                lowered_now = _lowered_now(job, produced.cache, lower_seconds)
                produced.localization = _localize(
                    job, backend, program, produced.report, expected, run_dir, lowered_now
                )
            log.info("[localize] %s", "\n".join(produced.localization.lines()))
        if not produced.passed:
            produced.repair = _repair_or_fail(job, backend, produced)
            # What the search found is the first artifact's; it stays in the repair's record.
            produced.localization = None
            with self.timed("repair"):
                assert program is not None
                lowered = self.repaired(program, expected)
            _repair_verdict(backend, produced)
        judged = "judged steps" if produced.report.sessions else "live shapes"
        log.info("[validate] passed at all %d %s", len(produced.report.shapes), judged)
        if produced.quality is not None and not produced.quality.passed:
            raise QualityFailed(
                f"{produced.quality.verdict()} Fidelity passed: the artifact computes what the "
                "quantized model computes; the quantization scheme costs more than the budget "
                f"({REPORT_FILE}'s quality section has the figures per case)."
            )
        return lowered

    def validated(self, lowered: Lowered, expected: Expected) -> None:
        """The artifact's constants audited against the lowered weights, which then go (before
        the artifact is loaded), then its outputs judged; the audit is kept where running the
        artifact fails."""
        produced = self.produced
        produced.weights_audit = audit.audit(lowered.artifact, lowered.weights, lowered.state)
        lowered.weights.clear()
        memory.release_freed()
        goldens = expected.goldens
        measuring = None
        if goldens.unquantized:
            logits_index = goldens.logits.index(True)
            measuring = quality_verdict.Measuring(goldens.unquantized, logits_index)
        produced.report = _validated(lowered.artifact, expected, measuring)
        report_file = self.record.run_dir / REPORT_FILE
        log.info("[validate] report (%s):\n%s", report_file, produced.report.table())
        if ran_on := produced.report.ran_on():
            log.info("[validate] ran on %s", ran_on)
        log.info("[validate] %s", "\n".join(produced.weights_audit.lines()))
        if measuring is not None:
            on_text, llama_cpp = None, None
            if goldens.text:
                on_text, llama_cpp = _on_text(lowered.artifact, expected, self.job)
            produced.quality = quality_verdict.judged(
                self.job.quantize.budget,
                measuring,
                goldens.quality,
                goldens.text,
                on_text,
                llama_cpp,
                produced.report.generation,
                (goldens.greedy or {}).get("tokenizer"),
            )
            log.info("[quality] %s", "\n".join(produced.quality.lines()))

    def repaired(self, program: ProgramFile, expected: Expected) -> Lowered:
        """The program lowered again with the repair's override, bundled and validated as the
        first artifact was; its values replace the first artifact's."""
        job, produced = self.job, self.produced
        assert produced.repair is not None
        keep_out = produced.repair.keep_out
        log.info("[repair] lowering again with %s", keep_out.override)
        repaired_job = dataclasses.replace(job, fallback=keep_out.fallback)
        repaired_backend = dataclasses.replace(self.backend, fallback=keep_out.fallback)
        lowered = _lower(program, repaired_job, repaired_backend, self.store)
        produced.artifact = lowered.artifact
        if job.bundle:
            produced.bundle = _bundle(job, self.record, lowered.artifact, expected)
        self.validated(lowered, expected)
        return lowered

    def benchmarked(
        self, program: ProgramFile | None, expected: Expected, lowered: Lowered
    ) -> None:
        """The artifact that passed, timed beside eager PyTorch."""
        produced = self.produced
        assert produced.report is not None
        with self.timed("benchmark"):
            produced.benchmark = _benchmark(
                self.job,
                self.backend,
                lowered.artifact,
                program,
                expected,
                produced.report.target,
                self.record.job_peak_rss_bytes,
            )
        log.info(
            "[benchmark] latency (%s):\n%s",
            self.record.run_dir / REPORT_FILE,
            produced.benchmark.table(),
        )


def _bounded_by_artifact(
    bundle: models.ModelBundle, job: config.JobConfig, llm_ops: config.LlmOps
) -> models.ModelBundle:
    """A given ExecuTorch program's inputs hold what its export bounded them to, which its
    runtime refuses to exceed: the live shapes go no further, and the job says so. A model with
    a KV cache is built again at those bounds, since its cache's slots follow them."""
    artifact = Path(job.artifact)
    if artifact.suffix != ".pte":
        return bundle
    try:
        inputs = input_sizes(artifact)
    except ValueError:
        return bundle  # not a program ExecuTorch reads: the runtime stage says why
    sizes = [value.sizes if isinstance(value, TensorValue) else None for value in inputs]
    if len(sizes) != len(bundle.input_names):
        raise ConfigError(
            f"artifact={artifact}: its program takes {len(sizes)} inputs, and "
            f"model={bundle.name} takes {len(bundle.input_names)} "
            f"({', '.join(bundle.input_names)}): it was not exported from this model."
        )
    bounded = bundle.bounded_by(str(artifact), sizes)
    lowered = {held.name: held.max for dim, held in zip(bundle.dims, bounded.dims, strict=True)
               if held.max < dim.max}  # fmt: skip
    for name, top in lowered.items():
        log.info(
            "[model] artifact=%s holds %s up to %d (its inputs' sizes): the live shapes go to "
            "%d, not dynamic.%s.max=%d",
            artifact, name, top, top, name, job.dynamic[name].max,
        )  # fmt: skip
    if not lowered or bundle.decoder is None:
        return bounded
    dynamic = {
        name: dataclasses.replace(bounds, max=lowered.get(name, bounds.max))
        for name, bounds in job.dynamic.items()
    }
    return models.build(job.model, dynamic, llm_ops)


def _export(
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    job: config.JobConfig,
    store: _Store,
) -> ProgramFile:
    """The exported program, linked into the run dir as program.pt2; a failed export leaves its
    diagnosis there (export_report.json / .txt) instead."""
    material = cache_keys.export(job, model_material)

    def build(out: Path) -> None:
        export.run(bundle, job.export.on_failure, out)

    try:
        with store.built("export", material, build) as folder:
            link_files(folder, store.run_dir)
            diagnosis = export.Diagnosis.read(folder)
    except export.ExportDiagnosed as failure:
        failure.diagnosis.write(store.run_dir)
        raise
    # The cache's entry stays; with the cache off, the staging folder went and the run dir's
    # links are the files.
    kept = folder if store.cache is not None else store.run_dir
    state = _cache_buffers(bundle)
    metadata = bundle.runner_metadata()
    return ProgramFile(kept, export.profiles(bundle), material, diagnosis, metadata, state)


def _planned(
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    job: config.JobConfig,
    group_scales: str | None,
    store: _Store,
) -> tuple[models.ModelBundle, quantize.plans.Plan]:
    """quantize=auto: the model quantized by its plan, searched on the quality text or taken from
    the cache, where an earlier job found it for the same model, settings and backend (plan.json,
    linked into the run dir)."""
    cfg, recipes = job.quantize, job.backend.quantize_recipes()
    rows, on_text = quality.eval_rows(bundle, cfg.eval_text, job.validate.seed)
    log.info("[quantize] planning on %d positions of %s", rows.positions, rows.source)

    def measure() -> quantize.plans.Measure:
        return quantize.plans.Measure(bundle.module, quality.logits_runner(bundle), rows.rows)

    searched: list[models.ModelBundle] = []

    def build(out: Path) -> None:
        planned, found = quantize.planned(
            bundle, cfg, recipes, measure, on_text, None, group_scales
        )
        searched.append(planned)
        write_json(out / PLAN_FILE, found.to_json())

    with store.built("plan", cache_keys.plan(job, model_material), build) as folder:
        link_files(folder, store.run_dir)
        found = quantize.plans.Plan.from_json(json.loads((folder / PLAN_FILE).read_text()))
    if searched:
        return searched[0], found
    return quantize.planned(bundle, cfg, recipes, measure, on_text, found, group_scales)


def _cache_buffers(bundle: models.ModelBundle) -> frozenset[str]:
    return frozenset(bundle.decoder.cache_buffers if bundle.decoder else ())


def _goldens(
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    job: config.JobConfig,
    device: str,
    store: _Store,
) -> Expected:
    """The planned live shapes, their inputs, the float64 oracle's outputs for them and eager's
    error at the model's dtype on `device`. Kept in the cache, and linked into the run dir only
    by its bundle: they are not a result, and can be larger than the artifact."""
    seed = job.validate.seed
    if bundle.decoder is None:
        shapes = plan(bundle.dims, job.validate.extra_shapes, job.validate.random_shapes, seed)

        def compute() -> stored_goldens.Goldens:
            return goldens.compute(bundle, shapes, seed, device, job.quantize.eval_text)

    else:
        (seq,) = bundle.dims
        planned = sessions.plan(bundle.decoder, seq, job.validate.sampled_positions, seed)
        shapes = [s for i, session in enumerate(planned) for s in judged_steps(i, session)]

        def compute() -> stored_goldens.Goldens:
            return sessions.compute(
                bundle,
                planned,
                job.validate.greedy_tokens,
                device,
                job.validate.prompt,
                job.quantize.eval_text,
                seed,
            )

    material = cache_keys.goldens(job, model_material, shapes)
    store.use.keys["goldens"] = key_of(material)

    names, tolerances = tuple(bundle.output_names), _tolerances(job)
    if store.cache is None:
        return Expected(names, shapes, compute(), None, tolerances)
    folder, store.use.hits["goldens"] = store.cache.fetch(
        "goldens", material, lambda out: stored_goldens.save(compute(), out)
    )
    file = folder / stored_goldens.GOLDENS_FILE
    return Expected(names, shapes, stored_goldens.load(folder), file, tolerances)


def _tolerances(job: config.JobConfig) -> validate.Tolerances:
    return validate.Tolerances(
        job.validate.rule.value,
        job.atol,
        job.rtol,
        job.factor,
        job.validate.floor,
        job.validate.half.value,
        job.validate.kl_factor,
        job.validate.top1_slack,
    )


def _lower(
    program: ProgramFile, job: config.JobConfig, backend: ConfiguredBackend, store: _Store
) -> Lowered:
    """The program, loaded now with weights of its own, lowered to `backend` and linked into
    the run dir; with the program's weights for the audit. `job` keys the cache's entry."""
    exported = program.load()
    # Taken before lowering, which may change the program.
    weights = {**exported.program.state_dict, **exported.program.constants}
    material = cache_keys.lower(job, program.material)
    with store.built("lower", material, lambda out: backend.lower(exported, out)) as folder:
        # Checked before the run dir gets the artifact: a job that breaks the policy leaves none.
        backend.check_fallback(backend.lowered_in(folder))
        link_files(folder, store.run_dir)
    return Lowered(backend.lowered_in(store.run_dir), weights, program.state)


def _validated(
    artifact: Artifact, expected: Expected, measuring: quality_verdict.Measuring | None
) -> validate.Report:
    """The artifact's outputs at every live shape, judged against the goldens under the rule;
    a quantized artifact's quality measured on them too, where `measuring`."""
    return validate.run(
        expected.output_names,
        _loader(artifact),
        expected.shapes,
        expected.goldens,
        expected.tolerances,
        measuring.add if measuring else lambda key, outputs: None,
    )


def _on_text(
    artifact: Artifact, expected: Expected, job: config.JobConfig
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The artifact's own figures on the quality text (exporter/validate/text.py), on an
    instance of its own; with quantize.llama_cpp, llama.cpp's on the GGUF file beside them."""
    goldens = expected.goldens
    slots = len(goldens.sessions[0]["tokens"]) if goldens.sessions else None
    longest = max(bounds.max for bounds in job.dynamic.values())
    log.info("[quality] the artifact on %s", goldens.text["source"])
    try:
        logits = text.run(_loader(artifact), goldens.text, slots, longest)
    except ArtifactFailed as error:
        raise RuntimeFailed(str(error)) from error
    found = text.measured(goldens.text["float"], logits, goldens.text["rows"])
    if not job.quantize.llama_cpp:
        return found, None
    checkpoint = hf_checkpoint.gguf_file(Path(job.model.checkpoint))
    log.info("[quality] llama.cpp on %s, the same rows", checkpoint)
    try:
        beside = text.run(
            lambda: load_runtime(checkpoint, "llama_cpp"), goldens.text, slots, longest
        )
    except ArtifactFailed as error:
        raise RuntimeFailed(f"llama.cpp (quantize.llama_cpp): {error}") from error
    return found, text.measured(goldens.text["float"], beside, goldens.text["rows"])


def _bundle(
    job: config.JobConfig, record: JobRecord, artifact: Artifact, expected: Expected
) -> bundles.Bundle:
    """bundle/ in the run dir: links to the artifact's files and the goldens (written there
    when the cache is off), and the manifest that runs them on a target as this job will (a
    model with a KV cache: by its sessions)."""
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
    sessions = expected.goldens.sessions
    written = bundles.write(
        record.run_dir / BUNDLE_DIR,
        artifact.files(),
        expected.source,
        artifact.runtime,
        artifact.device,
        expected.output_names,
        expected.shapes,
        # A session's judged steps run in order on one instance, between the steps not judged.
        [(shape, SAME_INSTANCE) for shape in expected.shapes]
        if sessions
        else executions(expected.shapes),
        expected.tolerances,
        source,
        outline(sessions),
    )
    log.info(
        "[bundle] %s: %s (%.1f MB); check it on a target with: python -m runtimes.check %s",
        written.folder,
        ", ".join(written.files),
        written.total_bytes / 1e6,
        written.folder,
    )
    return written


def _repair_or_fail(
    job: config.JobConfig, backend: ConfiguredBackend, produced: Produced
) -> repair.Repair:
    """A failed validation's repair: the override that keeps the diverging op out of the
    delegate, where the search found one and validate.repair=auto asks for it; otherwise the
    job fails with validation's message."""
    assert produced.report is not None and produced.weights_audit is not None
    # Weights that differ are no kernel's doing: no op to keep out.
    assert produced.artifact is not None
    keep_out = (
        repair.keep_out(produced.localization, produced.artifact.partition, job.fallback)
        if produced.weights_audit.passed
        else None
    )
    message = _failure_message(produced, keep_out, backend.half_precision)
    if keep_out is None or job.validate.repair is config.RepairMode.off:
        raise ValidationFailed(message)
    log.warning("[validate] %s", message)
    return repair.Repair(
        keep_out, message, _report_payload(produced), produced.cache.keys.get("lower")
    )


def _repair_verdict(backend: ConfiguredBackend, produced: Produced) -> None:
    """The repaired artifact's verdict, kept in the repair's record: the job fails where it
    fails too."""
    assert produced.repair is not None and produced.report is not None
    found = produced.repair
    found.passed = produced.passed
    if not found.passed:
        repaired_failure = _failure_message(produced, None, backend.half_precision)
        raise ValidationFailed(
            f"validate.repair=auto lowered again with {found.keep_out.override}, and that "
            f"artifact fails too: {repaired_failure} The first artifact: {found.first_failure}"
        )
    log.info(
        "[repair] the artifact lowered again with %s passes; the first one failed: %s",
        found.keep_out.override,
        found.first_failure,
    )


def _benchmark(
    job: config.JobConfig,
    backend: ConfiguredBackend,
    artifact: Artifact,
    program: ProgramFile | None,
    expected: Expected,
    target: Mapping[str, str],
    job_peak: int | None,
) -> benchmark.Benchmark:
    """The artifact's latency at every live shape (with a KV cache: its prefills and decode
    steps), beside eager PyTorch's on the device that matches the artifact's `target`;
    `job_peak`, the job's peak RSS so far, which loading both at once should not pass."""
    timed = benchmark.Subject(
        artifact.runtime, artifact.device, _loader(artifact), artifact.file_bytes()
    )
    eager = _eager(program, backend, target)
    settings = job.benchmark
    if expected.goldens.sessions:
        sessions = expected.goldens.sessions
        return benchmark.run_sessions(sessions, timed, eager, settings, job_peak)
    return benchmark.run(
        expected.shapes,
        lambda shape: expected.goldens.cases[label(shape)][0],
        timed,
        eager,
        settings,
        job_peak,
    )


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


def _failure_message(
    produced: Produced, keep_out: repair.KeepOut | None, backend_precision: str | None
) -> str:
    """Validation's message, with what the backend is known to lose at the model's dtype where
    values differ, then the weights that differ, then where the outputs diverge and, where that
    is one op's doing, the override that keeps the op out of the delegate."""
    report, weights_audit, localization = (
        produced.report,
        produced.weights_audit,
        produced.localization,
    )
    assert report is not None
    sentences = [report.failure_message()] if not report.passed else []
    differ = any(o.values_differ for e in report.executions for o in e.outputs)
    if differ and backend_precision:
        sentences.append(backend_precision)
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
    if isinstance(localization, localize.FirstDivergence):
        found = localization
        sentences.append(
            f"The first node that diverges is {found.summary()} in {found.module or 'the model'}"
            f", at {found.source or 'an unknown source line'}."
        )
        if keep_out:
            sentences.append(keep_out.advice())
    elif isinstance(localization, localize.NotReproduced):
        sentences.append("Lowering the program again does not reproduce the failure.")
    if produced.quality is not None:
        sentences.append(f"Apart from fidelity, {produced.quality.verdict()}")
    return " ".join(sentences) + f" ({REPORT_FILE} in the run dir says more.)"


def _write_report(run_dir: Path, produced: Produced) -> None:
    """report.json: validation's report, and what later stages found, each in its section."""
    write_json(run_dir / REPORT_FILE, json_safe(_report_payload(produced)), "the report")


def _report_payload(produced: Produced) -> dict[str, Any]:
    assert produced.report is not None
    sections = {
        "quantization": produced.quantization and produced.quantization.to_json(),
        "weights_audit": produced.weights_audit and produced.weights_audit.to_json(),
        "first_divergence": produced.localization and produced.localization.to_json(),
        "benchmark": produced.benchmark and produced.benchmark.to_json(),
        "bundle": produced.bundle
        and {
            "folder": produced.bundle.folder.name,
            "bytes": produced.bundle.total_bytes,
            "files": dict(produced.bundle.files),
        },
        "repair": produced.repair and produced.repair.to_json(),
        "quality": produced.quality and produced.quality.to_json(),
        "attribution": produced.attribution and produced.attribution.to_json(),
    }
    return {**produced.report.to_json(), **{k: v for k, v in sections.items() if v}}


def _localizes(mode: config.LocalizeMode, report: validate.Report) -> bool:
    """Whether the job searches for the first diverging node: on failure (auto) where an
    output's values differ (a wrong dtype alone is no divergence), or always."""
    if mode is config.LocalizeMode.always:
        return True
    differ = any(o.values_differ for e in report.executions for o in e.outputs)
    return mode is config.LocalizeMode.auto and differ


def _localize(
    job: config.JobConfig,
    backend: ConfiguredBackend,
    program: ProgramFile | None,
    report: validate.Report,
    expected: Expected,
    run_dir: Path,
    lowered_now: tuple[str, float | None],
) -> localize.Localization:
    """The first node of the job's exported program that diverges at the first execution that
    failed (on a passing job, at its worst), replayed as validation ran it. What stops the
    search is its result's reason: the job's verdict is validation's either way."""
    # The budget counts from here: loading (or exporting) the program is part of the search.
    started = time.perf_counter()
    tolerances = expected.tolerances
    replay = _replay(report, expected.goldens, tolerances)
    names = report.output_names
    # A .partial- folder: what a stopped job's worker leaves of it is removed
    # (exporter/job/worker.py).
    work_dir = Path(tempfile.mkdtemp(dir=run_dir, prefix=f"{PARTIAL_PREFIX}localize-"))
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
            lowered_now=lowered_now[0],
            budget_seconds=job.validate.localize_seconds,
            full_lowering_seconds=lowered_now[1],
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
        bundle = quantize.quantized(bundle, job.quantize, backend.group_scales)
    return export.run(bundle, job.export.on_failure, work_dir)


def _eager(
    program: ProgramFile | None, backend: ConfiguredBackend, target: Mapping[str, str]
) -> benchmark.Subject | None:
    """Eager PyTorch to time beside the artifact: the job's exported program, on the device
    that matches the artifact's; None where the job validated a given artifact and exported
    nothing. With a KV cache, the program's module keeps the cache in its buffers between
    calls, as the model does: the same graph as the artifact's, at the model's dtype, without
    the model held through the stages after export."""
    if program is None:
        return None
    device = backend.eager_device(target)
    path = program.path
    return benchmark.Subject(
        "eager", device, lambda: load_runtime(path, "eager", device), path.stat().st_size
    )
