"""The stages of a job after its config is checked, in the order they run: model -> quantize ->
export -> goldens -> lower -> bundle -> validate -> localize -> repair -> benchmark. Each is a
function of the values the ones before returned (the model's bundle, the exported program's
file, the goldens, the lowered artifact, the report: exporter/job/values.py), and `run` is the
sequence that calls them and keeps their values in the job's record as they come. They load
torch; the job's frame (exporter/job/pipeline.py) imports them once the config stage has passed,
so a configuration error is answered without loading it.

Plans, exported programs, goldens and lowered artifacts come from the cache when a job before
this one made them from the same inputs (the same config, code and libraries:
exporter/cache/keys.py, exporter/job/cached.py); the run dir gets links to them either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from exporter import audit, benchmark, config, export, models, quantize, validate
from exporter.artifact import Artifact
from exporter.backends import ConfiguredBackend
from exporter.cache import keys as cache_keys
from exporter.cache.store import Cache, link_files
from exporter.config import hf_checkpoint
from exporter.errors import ConfigError, QualityFailed, RuntimeFailed, ValidationFailed
from exporter.files import write_json
from exporter.job import localizing
from exporter.job.cached import CachedWork
from exporter.job.findings import REPORT_FILE, failure_message, report_payload, write_report
from exporter.job.timing import Notify, stage
from exporter.job.values import Expected, Lowered, ProgramFile, Running
from exporter.localize import repair
from exporter.process import memory
from exporter.quantize import attribution, quality
from exporter.quantize import verdict as quality_verdict
from exporter.tracking.record import JobRecord
from exporter.validate import goldens, sessions, text
from exporter.validate.plan import plan
from runtimes import Loaded
from runtimes import load as load_runtime
from runtimes.formats import bundle as bundles
from runtimes.formats.pte_file import TensorValue, input_sizes
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.errors import ArtifactFailed
from runtimes.verdict.sessions import judged as judged_steps
from runtimes.verdict.sessions import outline
from runtimes.verdict.shapes import SAME_INSTANCE, executions, label

log = logging.getLogger(__name__)

__all__ = ["REPORT_FILE", "run"]

PLAN_FILE = "plan.json"
BUNDLE_DIR = "bundle"


def run(
    job: config.JobConfig, backend: ConfiguredBackend, record: JobRecord, notify: Notify
) -> None:
    """The stages in the order they run, each handed the values of the ones before, each value
    kept in `record` as it comes; `backend` is the job's, resolved once by the frame.

    report.json is written when validation's verdict is known, and again by each stage after it
    that adds a section (localize, repair, benchmark), so a job that a later stage crashes or
    stops keeps what the stages before it found."""
    cache = Cache(Path(job.cache_dir)) if job.cache else None
    sequence = _Sequence(
        job, backend, record, notify, CachedWork(cache, record.run_dir, record.cache)
    )
    # The libraries are imported and the MLflow run is open: they last as long as the job.
    memory.spare_survivors()
    program, expected, state, weights, running = sequence.from_model()
    sequence.settle()
    lowered = sequence.lowered(program, state, weights)
    sequence.settle()
    if expected is None:
        log.info("[validate] skipped: %s is a report, with nothing to run", lowered.artifact.path)
        return
    sequence.bundled(lowered.artifact, expected, running)
    sequence.validated(lowered, expected)
    if localizing.searches(job.validate.localize, _report(record)):
        sequence.localized(program, expected)
    if not record.passed:
        lowered = sequence.repaired(program, expected, running)
    sequence.verdict()
    if job.benchmark.enabled:
        sequence.benchmarked(program, expected, lowered)


@dataclass(frozen=True)
class _Sequence:
    """What every stage of the sequence shares: the job, its backend, the job's record (which
    keeps the stages' values, their timings and cache use), how the frame is told of each stage,
    and where cached work comes from. Its methods are the stages, in the order they run."""

    job: config.JobConfig
    backend: ConfiguredBackend
    record: JobRecord
    notify: Notify
    work: CachedWork

    def timed(self, name: str) -> contextlib.AbstractContextManager[None]:
        return stage(self.record, name, self.notify)

    def settle(self) -> None:
        """Between stages that each hold a large value (the model, then its exported program,
        then the artifact): what the last one dropped is freed, and what is alive now lives on
        out of the collector's reach."""
        memory.release_freed()
        memory.spare_survivors()

    def from_model(
        self,
    ) -> tuple[ProgramFile | None, Expected | None, frozenset[str], dict[str, Any], Running]:
        """model -> quantize -> export -> goldens (-> attribution): the exported program (None
        for a given artifact), what artifacts are judged against (None where the backend makes
        a report), the model's buffers that its program writes as it runs (a KV cache), for
        a given artifact, the model's weights that its constants are audited against, and for a
        causal LM with a KV cache, what a target generates text with (None otherwise). The model
        is dropped on return: no stage after holds both it and its exported program."""
        job, record = self.job, self.record
        with self.timed("model"):
            bundle = models.build(job.model, job.dynamic, self.backend.llm_ops)
            if job.artifact:
                bundle = _bounded_by_artifact(bundle, job, self.backend.llm_ops)
            record.weight_bytes = models.weight_bytes(bundle.module)
            model_material = cache_keys.model(job)
        if job.quantize.enabled:
            with self.timed("quantize"):
                scales = self.backend.group_scales
                plan = None
                if job.quantize.scheme is config.QuantScheme("auto"):
                    bundle, plan = _planned(bundle, model_material, job, scales, self.work)
                else:
                    bundle = quantize.quantized(
                        bundle, job.quantize, scales, job.backend.int4_weight_packed
                    )
                record.quantization = quantize.summary(bundle.module, job.quantize, scales, plan)
                log.info("[quantize] %s", record.quantization.line())
        program = None
        if not job.artifact:
            with self.timed("export"):
                try:
                    program = _export(bundle, model_material, job, self.work)
                except export.ExportDiagnosed as failure:
                    failure.diagnosis.write(record.run_dir)
                    record.diagnosis = failure.diagnosis
                    raise
                record.diagnosis = program.diagnosis
        expected = None
        if self.backend.makes_runnable:
            with self.timed("goldens"):
                device = self.backend.reference_device
                expected = _goldens(bundle, model_material, job, device, self.work)
            if job.quantize.attribution and bundle.unquantized is not None:
                self.attributed(bundle.unquantized, expected)
        # A given artifact's constants are audited against the model's own weights.
        weights = {} if program else models.weights(bundle.module)
        running = Running(
            bundle.runner_metadata(),
            bundle.decoder.tokenizer if bundle.decoder else None,
            bundle.preprocessor,
        )
        return program, expected, _cache_buffers(bundle), weights, running

    def attributed(self, float_bundle: models.ModelBundle, expected: Expected) -> None:
        """quantize.attribution: the quality each layer costs, quantized alone, on the goldens'
        inputs; ranked by what it costs the next-token predictions, which a model without
        logits has none of."""
        if True not in expected.goldens.logits:
            log.info("[attribution] skipped: the model has no next-token logits to rank layers by")
            return
        with self.timed("attribution"):
            run = attribution.on_quality_rows(float_bundle, expected.goldens)
            found = attribution.attribute(
                float_bundle.module, run, self.job.quantize, self.job.backend.int4_weight_packed
            )
        self.record.attribution = found
        log.info("[attribution] %s", "\n".join(found.lines()))

    def lowered(
        self, program: ProgramFile | None, state: frozenset[str], weights: dict[str, Any]
    ) -> Lowered:
        """lower: the program lowered to the job's backend, or the given artifact adopted."""
        if program is None:
            lowered = Lowered(self.backend.adopt(Path(self.job.artifact)), weights, state)
            log.info("[lower] skipped: validating the given artifact %s", lowered.artifact.path)
        else:
            with self.timed("lower"):
                lowered = _lower(program, self.job, self.backend, self.work)
        self.record.artifact = lowered.artifact
        return lowered

    def bundled(self, artifact: Artifact, expected: Expected, running: Running) -> None:
        """bundle (bundle=on): what a target's check of the artifact needs, in the run dir, and
        what it generates text with where the model is a causal LM with a KV cache."""
        if self.job.bundle:
            with self.timed("bundle"):
                self.record.bundle = _bundle(self.job, self.record, artifact, expected, running)

    def validated(self, lowered: Lowered, expected: Expected) -> None:
        """validate: the artifact judged (`judge`), and report.json written."""
        with self.timed("validate"):
            self.judge(lowered, expected)
            write_report(self.record.run_dir, self.record)

    def judge(self, lowered: Lowered, expected: Expected) -> None:
        """The artifact's constants audited against the lowered weights, which then go (before
        the artifact is loaded), then its outputs judged, and a quantized artifact's quality
        measured. The audit is kept where running the artifact fails."""
        record, job = self.record, self.job
        record.weights_audit = audit.audit(lowered.artifact, lowered.weights, lowered.state)
        lowered.weights.clear()
        memory.release_freed()
        goldens = expected.goldens
        measuring = None
        if goldens.unquantized:
            logits_index = goldens.logits.index(True)
            measuring = quality_verdict.Measuring(goldens.unquantized, logits_index)
        record.report = _validated(lowered.artifact, expected, measuring)
        report_file = record.run_dir / REPORT_FILE
        log.info("[validate] report (%s):\n%s", report_file, record.report.table())
        if ran_on := record.report.ran_on():
            log.info("[validate] ran on %s", ran_on)
        log.info("[validate] %s", "\n".join(record.weights_audit.lines()))
        if measuring is not None:
            on_text, llama_cpp = None, None
            if goldens.text:
                on_text, llama_cpp = _on_text(lowered.artifact, expected, job)
            record.quality = quality_verdict.judged(
                job.quantize.budget,
                measuring,
                goldens.quality,
                goldens.text,
                on_text,
                llama_cpp,
                record.report.generation,
                (goldens.greedy or {}).get("tokenizer"),
            )
            log.info("[quality] %s", "\n".join(record.quality.lines()))

    def localized(self, program: ProgramFile | None, expected: Expected) -> None:
        """localize: the first node of the job's program that diverges, or why that is not
        known."""
        record = self.record
        with self.timed("localize"):
            record.localization = localizing.localized(
                self.job, self.backend, program, _report(record), expected, record
            )
            write_report(record.run_dir, record)
        log.info("[localize] %s", "\n".join(record.localization.lines()))

    def repaired(
        self, program: ProgramFile | None, expected: Expected, running: Running
    ) -> Lowered:
        """repair: where validation failed, the program lowered again with the override that
        keeps the diverging op out of the delegate, bundled and validated as the first artifact
        was; its values replace the first's. ValidationFailed where the search found no such
        op, validate.repair=off, or the repaired artifact fails too."""
        job, record = self.job, self.record
        keep_out = _keep_out(job, record)
        message = failure_message(record, keep_out, self.backend.half_precision)
        if keep_out is None or job.validate.repair is config.RepairMode.off:
            raise ValidationFailed(message)
        assert program is not None
        log.warning("[validate] %s", message)
        first = repair.Repair(
            keep_out, message, report_payload(record), record.cache.keys.get("lower")
        )
        record.repair = first
        # What the search found is the first artifact's; it stays in the repair's record.
        record.localization = None
        write_report(record.run_dir, record)
        with self.timed("repair"):
            log.info("[repair] lowering again with %s", keep_out.override)
            repaired_job = dataclasses.replace(job, fallback=keep_out.fallback)
            repaired_backend = dataclasses.replace(self.backend, fallback=keep_out.fallback)
            lowered = _lower(program, repaired_job, repaired_backend, self.work)
            record.artifact = lowered.artifact
            if job.bundle:
                record.bundle = _bundle(job, record, lowered.artifact, expected, running)
            self.judge(lowered, expected)
            first.passed = record.passed
            write_report(record.run_dir, record)
        if not first.passed:
            repaired_failure = failure_message(record, None, self.backend.half_precision)
            raise ValidationFailed(
                f"validate.repair=auto lowered again with {keep_out.override}, and that "
                f"artifact fails too: {repaired_failure} The first artifact: {first.first_failure}"
            )
        log.info(
            "[repair] the artifact lowered again with %s passes; the first one failed: %s",
            keep_out.override,
            first.first_failure,
        )
        return lowered

    def verdict(self) -> None:
        """The verdict once fidelity passed: quality, where a quantized artifact's costs more
        than quantize.budget, fails the job (QualityFailed)."""
        report, found = _report(self.record), self.record.quality
        judged = "judged steps" if report.sessions else "live shapes"
        log.info("[validate] passed at all %d %s", len(report.shapes), judged)
        if found is not None and not found.passed:
            raise QualityFailed(
                f"{found.verdict()} Fidelity passed: the artifact computes what the quantized "
                "model computes; the quantization scheme costs more than the budget "
                f"({REPORT_FILE}'s quality section has the figures per case)."
            )

    def benchmarked(
        self, program: ProgramFile | None, expected: Expected, lowered: Lowered
    ) -> None:
        """benchmark: the artifact that passed, timed beside eager PyTorch."""
        record = self.record
        with self.timed("benchmark"):
            record.benchmark = _benchmark(
                self.job,
                self.backend,
                lowered.artifact,
                program,
                expected,
                _report(record).target,
                record.job_peak_rss_bytes,
            )
            write_report(record.run_dir, record)
        log.info(
            "[benchmark] latency (%s):\n%s", record.run_dir / REPORT_FILE, record.benchmark.table()
        )


def _report(record: JobRecord) -> validate.Report:
    assert record.report is not None
    return record.report


def _keep_out(job: config.JobConfig, record: JobRecord) -> repair.KeepOut | None:
    """The override that keeps the op where the artifact first diverges out of the delegate,
    where the search found one; none where the weights differ, which is no kernel's doing."""
    assert record.weights_audit is not None and record.artifact is not None
    if not record.weights_audit.passed:
        return None
    return repair.keep_out(record.localization, record.artifact.partition, job.fallback)


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
    work: CachedWork,
) -> ProgramFile:
    """The exported program, linked into the run dir as program.pt2; a failed export leaves its
    diagnosis there (export_report.json / .txt) instead."""
    material = cache_keys.export(job, model_material)

    def build(out: Path) -> None:
        export.run(bundle, job.export, out)

    with work.built("export", material, build) as folder:
        link_files(folder, work.run_dir)
        diagnosis = export.Diagnosis.read(folder)
    # The cache's entry stays; with the cache off, the staging folder went and the run dir's
    # links are the files.
    kept = folder if work.cache is not None else work.run_dir
    state = _cache_buffers(bundle)
    metadata = bundle.runner_metadata()
    return ProgramFile(kept, export.profiles(bundle), material, diagnosis, metadata, state)


def _planned(
    bundle: models.ModelBundle,
    model_material: dict[str, Any],
    job: config.JobConfig,
    group_scales: str | None,
    work: CachedWork,
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

    with work.built("plan", cache_keys.plan(job, model_material), build) as folder:
        link_files(folder, work.run_dir)
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
    work: CachedWork,
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
    found, entry = work.kept("goldens", material, compute, stored_goldens.save, stored_goldens.load)
    file = entry / stored_goldens.GOLDENS_FILE if entry else None
    return Expected(tuple(bundle.output_names), shapes, found, file, _tolerances(job))


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
    program: ProgramFile, job: config.JobConfig, backend: ConfiguredBackend, work: CachedWork
) -> Lowered:
    """The program, loaded now with weights of its own, lowered to `backend` and linked into
    the run dir; with the program's weights for the audit. `job` keys the cache's entry."""
    exported = program.load()
    # Taken before lowering, which may change the program; a decoder's encode method's too.
    programs = [exported.program, *([exported.encode] if exported.encode else [])]
    weights = {name: w for p in programs for name, w in {**p.state_dict, **p.constants}.items()}
    material = cache_keys.lower(job, program.material)
    with work.built("lower", material, lambda out: backend.lower(exported, out)) as folder:
        # Checked before the run dir gets the artifact: a job that breaks the policy leaves none.
        backend.check_fallback(backend.lowered_in(folder))
        link_files(folder, work.run_dir)
    return Lowered(backend.lowered_in(work.run_dir), weights, program.state)


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
    job: config.JobConfig,
    record: JobRecord,
    artifact: Artifact,
    expected: Expected,
    running: Running,
) -> bundles.Bundle:
    """bundle/ in the run dir: links to the artifact's files and the goldens (written there
    when the cache is off), and the manifest that runs them on a target as this job will (a
    model with a KV cache: by its sessions); what a target runs the model with beside it (a
    causal LM's runner metadata and tokenizer, an image classifier's image processor)."""
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
        running.runner_metadata,
        _tokenizer_saver(running),
        running.preprocessor,
    )
    log.info(
        "[bundle] %s: %s (%.1f MB); check it on a target with: python -m runtimes.check %s",
        written.folder,
        ", ".join(written.files),
        written.total_bytes / 1e6,
        written.folder,
    )
    return written


def _tokenizer_saver(running: Running) -> Callable[[Path], object] | None:
    """What writes the checkpoint's tokenizer into a folder as standard files (save_pretrained:
    a GGUF file's vocabulary and chat template too); None where the model has none, or none
    that transformers loads (a checkpoint of weights alone), which only costs the bundle text:
    a target still generates from it with token ids."""
    if running.tokenizer is None:
        return None
    try:
        tokenizer = running.tokenizer()
    except ConfigError as error:
        reason = " ".join(str(error.__cause__ or error).split())
        log.info(
            "[bundle] no tokenizer/ (a target generates from the bundle with --ids): "
            "transformers cannot load the checkpoint's: %s",
            reason,
        )
        return None
    return tokenizer.save_pretrained


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
