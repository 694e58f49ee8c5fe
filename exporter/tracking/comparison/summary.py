"""One job as a row of the comparison: what it chose, how it ended, its errors, speed and size.

Each job writes its summary.json into its run dir when it ends, whatever process runs it; a
sweep's comparison reads them back from the sweep dir.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from exporter.files import write_json
from exporter.process.memory import GB
from exporter.tracking.record import JobRecord

SUMMARY_FILE = "summary.json"
# What the sweep sees of a job: Hydra makes its folder and .hydra/ before the job runs.
HYDRA_CONFIG = Path(".hydra") / "hydra.yaml"


def metric(name: str, unit: float = 1) -> dict[str, Any]:
    """A field's metadata: the job's MLflow run logs the figure as metric `name`, in `unit`s."""
    return {"metric": name, "unit": unit}


def tag(name: str) -> dict[str, Any]:
    """A field's metadata: the job's MLflow run logs the finding, where there is one, as tag
    `name` (a dict's items as tags `name.key`, a list's items joined by commas)."""
    return {"tag": name}


def group_choices(choices: Mapping[str, object]) -> dict[str, str]:
    """Hydra's choice per top-level group; nested groups are schemas and Hydra's own."""
    return {group: str(choice) for group, choice in choices.items() if "/" not in group}


@dataclass
class JobSummary:
    """A job's figures and findings. A field that the job's MLflow run logs says so, and under
    which name, in its metadata (`metric`, `tag`): a figure added here with its name, and taken
    from the record in `of`, is in summary.json and the run."""

    job: str
    choices: dict[str, str]
    # passed, failed, killed; "no result" for a job that never wrote its summary.
    status: str
    exit_code: int | None
    failed_stage: str | None = field(default=None, metadata=tag("failed_stage"))
    error: str | None = None
    worst_max_abs_err: float | None = None
    worst_nrmse: float | None = None
    # The artifact's error over eager's at the model's dtype (the report's `ratio`), at its
    # worst live shape, and that shape; None where no shape measured it.
    worst_error_ratio: float | None = None
    worst_error_ratio_at: str | None = None
    # The live shapes that failed validation, by label (`seq=1`).
    failed_shapes: list[str] = field(default_factory=list)
    # A model with a KV cache: its greedy generation beside eager's and the oracle's, in a line.
    greedy: str | None = None
    # What failed validation: "fidelity" (the artifact against the model it was made from),
    # "quality" (a quantized artifact against the float model), or both.
    failed_on: str | None = field(default=None, metadata=tag("failed_on"))
    # A quantized model: the artifact's quality against the float model where the budget judges
    # it (on the quality text, else on the validation inputs: mean, p99 KL divergence in nats,
    # top-1 agreement, mean drop of the float top token's probability), the perplexity ratio on
    # the text, its verdict, and the layers whose
    # quantization costs the most (quantize.attribution), worst first.
    quality_passed: bool | None = None
    # quantize=auto: the plan in a line (its layers and bytes by recipe).
    quantization_plan: str | None = field(default=None, metadata=tag("quantize.plan"))
    quality_kld_mean: float | None = None
    quality_kld_p99: float | None = None
    quality_top1: float | None = None
    quality_prob_drop: float | None = None
    quality_ppl_ratio: float | None = None
    # The float model's greedy tokens beside the artifact's, in a line (a KV-cache model).
    quality_greedy: str | None = None
    costliest_layers: list[str] = field(
        default_factory=list, metadata=tag("quality.costliest_layers")
    )
    # Where the artifact first diverges (`node (op)`), "not reproduced" where lowering the
    # program again does not, "not localized" where the search could not say; None where no
    # search ran.
    diverged_at: str | None = field(default=None, metadata=tag("diverged_at"))
    # validate.repair=auto at work: the override, the first artifact's verdict and the
    # repaired one's (logged as tags repair.*).
    repair: dict[str, str] = field(default_factory=dict, metadata=tag("repair"))
    # The weights audit: how many parameters it checked, found changed and could not see.
    weights_checked: int | None = field(default=None, metadata=metric("weights_checked"))
    weights_mismatched: int | None = field(default=None, metadata=metric("weights_mismatched"))
    weights_unseen: int | None = field(default=None, metadata=metric("weights_unseen"))
    # The benchmark's median latency at the smallest and largest live shape, and the smallest
    # of eager's median over the artifact's (below 1: slower than eager somewhere).
    latency_at_min_ms: float | None = None
    latency_at_max_ms: float | None = None
    worst_speedup_vs_eager: float | None = field(
        default=None, metadata=metric("worst_speedup_vs_eager")
    )
    # A model with a KV cache: tokens per second of a decode step at the cache's last slot and
    # of the longest prefill.
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    # On a GPU: the slowest decode step's time over the floor of reading the artifact's bytes at
    # the card's peak memory bandwidth (1: as fast as the memory allows).
    worst_decode_floor_ratio: float | None = field(
        default=None, metadata=metric("worst_decode_floor_ratio")
    )
    # How the benchmark timed: threads, the artifact's clock, eager's device (logged as tags).
    benchmark: dict[str, str] = field(default_factory=dict, metadata=tag("benchmark"))
    artifact_bytes: int | None = field(default=None, metadata=metric("artifact_bytes"))
    delegated_fraction: float | None = field(default=None, metadata=metric("delegated_fraction"))
    fallback_op_count: int | None = field(default=None, metadata=metric("fallback_op_count"))
    # The kinds of problem draft_export found when torch.export failed, and whether the job
    # went on with draft_export's program (export.on_failure=draft).
    export_failures: list[str] = field(default_factory=list, metadata=tag("export.failure_kinds"))
    # The program came from draft_export: valid for inputs that branch like the example.
    draft: bool = field(default=False, metadata=tag("export.draft"))
    # Wall seconds per stage that ran: config, startup, model, export, lower, goldens, validate.
    seconds: dict[str, float] = field(default_factory=dict)
    # Wall seconds from the job's start (its config composed) to its record's end.
    total_s: float | None = None
    # Peak RSS of the job's worker per stage that ran and over the job, the model's weights, and
    # the job's peak over them (JobRecord says what each covers). Host memory only.
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    job_peak_rss_bytes: int | None = field(default=None, metadata=metric("peak_rss_gb", GB))
    peak_rss_scope: str | None = field(default=None, metadata=tag("peak_rss_scope"))
    weight_bytes: int | None = field(default=None, metadata=metric("weight_gb", GB))
    peak_rss_over_weights: float | None = field(
        default=None, metadata=metric("peak_rss_over_weights")
    )
    # Per cached stage: whether its work came from the cache, and the key of its entry.
    cache_hits: dict[str, bool] = field(default_factory=dict, metadata=tag("cache_hit"))
    cache_keys: dict[str, str] = field(default_factory=dict, metadata=tag("cache_key"))
    # What the artifact ran on, where its runtime says (a wgpu adapter): logged as tags.
    target: dict[str, str] = field(default_factory=dict, metadata=tag("target"))
    # Per live shape, smallest first: its size per dynamic dim, the worst error, and where the
    # benchmark ran, the median latency with its 10th and 90th percentiles, eager's median and
    # the speedup over it (None where eager did not run).
    shapes: list[dict[str, int]] = field(default_factory=list)
    max_abs_err: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    latency_p10_ms: list[float] = field(default_factory=list)
    latency_p90_ms: list[float] = field(default_factory=list)
    eager_latency_ms: list[float | None] = field(default_factory=list)
    speedup_vs_eager: list[float | None] = field(default_factory=list)

    @classmethod
    def of(cls, record: JobRecord, choices: dict[str, str]) -> JobSummary:
        summary = cls(
            job=record.run_dir.name,
            choices=choices,
            status=record.outcome,
            exit_code=record.exit_code,
            failed_stage=record.failed_stage,
            seconds=dict(record.seconds),
            total_s=(record.ended_ms - record.started_ms) / 1000 if record.ended_ms else None,
            peak_rss_bytes=dict(record.peak_rss_bytes),
            job_peak_rss_bytes=record.job_peak_rss_bytes,
            peak_rss_scope=record.peak_rss_scope,
            weight_bytes=record.weight_bytes,
            cache_hits=dict(record.cache.hits),
            cache_keys=dict(record.cache.keys),
        )
        # A stopped job's error says what stopped it.
        summary.error = str(record.error) if record.error else record.stop_reason
        if record.job_peak_rss_bytes and record.weight_bytes:
            summary.peak_rss_over_weights = record.job_peak_rss_bytes / record.weight_bytes
        if record.artifact and record.artifact.path.exists():
            summary.artifact_bytes = record.artifact.file_bytes()
            if record.artifact.partition:
                summary.delegated_fraction = record.artifact.partition.delegated_fraction
                summary.fallback_op_count = record.artifact.partition.fallback_op_count
        if record.diagnosis:
            summary.export_failures = record.diagnosis.kinds
            summary.draft = record.diagnosis.continued_with_draft
        if record.report:
            results = record.report.by_shape()
            summary.target = dict(record.report.target)
            summary.worst_max_abs_err = record.report.worst("max_abs")
            summary.worst_nrmse = record.report.worst("nrmse")
            summary.shapes = [dict(result.shape) for result in results]
            summary.max_abs_err = [result.stats["max_abs"] for result in results]
            summary.failed_shapes = record.report.failed_labels()
            if worst := record.report.worst_ratio_at():
                summary.worst_error_ratio, summary.worst_error_ratio_at = worst
            if record.report.generation:
                summary.greedy = record.report.generation.summary()
        if record.quantization and record.quantization.plan:
            summary.quantization_plan = record.quantization.plan.summary()
        if record.quality:
            _take_quality(summary, record)
        if record.attribution:
            summary.costliest_layers = record.attribution.worst_names()
        if record.weights_audit:
            found = record.weights_audit
            summary.weights_checked = len(found.checked)
            summary.weights_mismatched = len(found.mismatched) + len(found.corrupted)
            summary.weights_unseen = len(found.unseen)
        if record.localization:
            summary.diverged_at = record.localization.summary()
        if record.repair:
            summary.repair = record.repair.summary()
        if record.benchmark:
            timed = record.benchmark.shapes
            summary.latency_ms = [shape.artifact.median_ms for shape in timed]
            summary.latency_p10_ms = [shape.artifact.p10_ms for shape in timed]
            summary.latency_p90_ms = [shape.artifact.p90_ms for shape in timed]
            summary.eager_latency_ms = [
                shape.eager.median_ms if shape.eager else None for shape in timed
            ]
            summary.speedup_vs_eager = [shape.speedup_vs_eager for shape in timed]
            if timed:
                summary.latency_at_min_ms = summary.latency_ms[0]
                summary.latency_at_max_ms = summary.latency_ms[-1]
            calls = record.benchmark.decode or record.benchmark.prefill
            if record.benchmark.decode:
                summary.decode_tokens_per_s = record.benchmark.decode[-1].tokens_per_s
            if record.benchmark.prefill:
                summary.prefill_tokens_per_s = record.benchmark.prefill[-1].tokens_per_s
            summary.worst_speedup_vs_eager = record.benchmark.worst_speedup_vs_eager()
            summary.worst_decode_floor_ratio = max(record.benchmark.floor_ratios(), default=None)
            summary.benchmark = {
                "threads": str(record.benchmark.threads),
                "clock": (timed or calls)[0].artifact.clock,
                "eager_device": record.benchmark.eager_device or "none",
                "together": str(record.benchmark.together).lower(),
            }
        return summary

    def metrics(self) -> dict[str, float]:
        """The figures declared with `metric`, by their MLflow names, where measured."""
        return {
            f.metadata["metric"]: value / f.metadata["unit"]
            for f in fields(self)
            if "metric" in f.metadata and (value := getattr(self, f.name)) is not None
        }

    def tags(self) -> dict[str, str]:
        """The findings declared with `tag`, by their MLflow names, where there are any."""
        found = {}
        for f in fields(self):
            name, value = f.metadata.get("tag"), getattr(self, f.name)
            if name is None or not value:
                continue
            if isinstance(value, dict):
                found |= {f"{name}.{key}": _tag_value(item) for key, item in value.items()}
            elif isinstance(value, list):
                found[name] = ",".join(value)
            else:
                found[name] = _tag_value(value)
        return found

    def verdict(self) -> str:
        """How the job ended and its figures, in one line (its MLflow run's description):
        `passed (exit 0) at all 7 live shapes: worst error ratio 2.24 at seq=1 (artifact's
        error / eager's); speedup over eager 2.43x..53.5x`."""
        figures = "; ".join(self.figures())
        return f"{self.outcome()}: {figures}" if figures else self.outcome()

    def outcome(self, exit_code: int | None = None) -> str:
        """How the job ended: `passed (exit 0) at all 7 live shapes`, `failed (exit 1) at the
        validate stage: 2 of 7 live shapes failed: seq=1, seq=2`, `killed (exit 130) during the
        lower stage: stopped by Ctrl-C (SIGINT)`. `exit_code`: the command's, where it differs
        from the job's (a passed job whose MLflow run could not be written exits 7)."""
        if self.exit_code is None:
            return "no result: the job's process ended without recording how the job ended"
        exit_code = self.exit_code if exit_code is None else exit_code
        code = f"(exit {exit_code})"
        if self.status == "killed":
            signal_name = signal.Signals(exit_code - 128).name if exit_code > 128 else "a signal"
            reason = self.error or f"stopped by {signal_name}"
            return f"killed {code} during the {self.failed_stage} stage: {reason}"
        if self.status == "passed":
            shapes = f" at all {self._judged()}" if self.shapes else ""
            tracking = "; its MLflow run was not written" if exit_code else ""
            return f"passed {code}{shapes}{tracking}"
        on = f" ({self.failed_on})" if self.failed_on else ""
        if self.failed_stage == "validate" and self.failed_shapes:
            why = f"{len(self.failed_shapes)} of {self._judged()} failed: " + ", ".join(
                self.failed_shapes
            )
        else:
            why = (self.error or "").split("\n", 1)[0]
        return f"failed {code} at the {self.failed_stage} stage{on}: {why}"

    def _judged(self) -> str:
        """What validation judged: `7 live shapes`, or `18 judged steps of 3 sessions` for a
        model with a KV cache (its shapes name their session)."""
        sessions = {shape["session"] for shape in self.shapes if "session" in shape}
        if sessions:
            return f"{len(self.shapes)} judged steps of {len(sessions)} sessions"
        return f"{len(self.shapes)} live shapes"

    def figures(self) -> list[str]:
        """The worst error ratio, the speedup range over eager and, with a KV cache, decode
        tokens/s at the last slot, the slowest decode step over the memory floor and the worst
        speedup, where they were measured."""
        figures = []
        if self.worst_error_ratio is not None:
            figures.append(
                f"worst error ratio {self.worst_error_ratio:.3g} at {self.worst_error_ratio_at} "
                "(artifact's error / eager's)"
            )
        if self.quantization_plan is not None:
            figures.append(self.quantization_plan)
        if self.quality_kld_mean is not None:
            ppl = f", perplexity x{self.quality_ppl_ratio:.3g}" if self.quality_ppl_ratio else ""
            figures.append(
                f"quality vs float: KLD {self.quality_kld_mean:.3g}, top-1 "
                f"{self.quality_top1:.3g}{ppl}"
            )
        if speedups := self.speedup_range():
            figures.append(f"speedup over eager {speedups[0]:.3g}x..{speedups[1]:.3g}x")
        if self.decode_tokens_per_s is not None:
            figures.append(f"decode {self.decode_tokens_per_s:.0f} tokens/s at the last slot")
            if self.worst_decode_floor_ratio is not None:
                figures.append(
                    f"decode at worst {self.worst_decode_floor_ratio:.2f}x the memory floor"
                )
            if self.worst_speedup_vs_eager is not None:
                figures.append(
                    f"speedup over eager at worst {self.worst_speedup_vs_eager:.3g}x "
                    "(prefill and decode)"
                )
        return figures

    def speedup_range(self) -> tuple[float, float] | None:
        """The smallest and largest speedup over eager among the live shapes the benchmark timed
        beside eager; None where it timed none."""
        speedups = [speedup for speedup in self.speedup_vs_eager if speedup is not None]
        return (min(speedups), max(speedups)) if speedups else None

    @classmethod
    def missing(cls, job_dir: Path) -> JobSummary:
        """A job whose process ended without a summary: killed, or crashed outside Python."""
        hydra = OmegaConf.load(job_dir / HYDRA_CONFIG).hydra
        choices = group_choices(OmegaConf.to_container(hydra.runtime.choices))
        return cls(job=job_dir.name, choices=choices, status="no result", exit_code=None)

    def write(self, folder: Path) -> Path:
        return write_json(folder / SUMMARY_FILE, asdict(self), "the job's summary")

    @classmethod
    def read(cls, folder: Path) -> JobSummary:
        payload = json.loads((folder / SUMMARY_FILE).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in payload.items() if key in known})


def _tag_value(value: object) -> str:
    # MLflow's own tags spell booleans in lower case.
    return str(value).lower() if isinstance(value, bool) else str(value)


def _take_quality(summary: JobSummary, record: JobRecord) -> None:
    """The quality verdict's figures, and what failed where validation failed."""
    quality = record.quality
    assert quality is not None
    summary.quality_passed = quality.passed
    judged = quality.under_budget
    if judged is not None:
        _, found = judged
        summary.quality_kld_mean = found["kld_mean"]
        summary.quality_kld_p99 = found["kld_p99"]
        summary.quality_top1 = found["top1"]
        summary.quality_prob_drop = found["prob_drop"]
        summary.quality_ppl_ratio = found.get("perplexity_ratio")
    if quality.greedy is not None:
        summary.quality_greedy = quality.greedy["line"]
        if "text" in quality.greedy:
            text = quality.greedy["text"]
            summary.quality_greedy += f": float {text['float']!r}, artifact {text['artifact']!r}"
    if summary.failed_stage != "validate":
        return
    fidelity_failed = not (
        record.report is not None
        and record.report.passed
        and (record.weights_audit is None or record.weights_audit.passed)
    )
    failed = [
        name
        for name, bad in (("fidelity", fidelity_failed), ("quality", not quality.passed))
        if bad
    ]
    summary.failed_on = " and ".join(failed) or None


def collect(sweep_dir: Path) -> list[JobSummary]:
    """Every job of a sweep, in job order, with or without a summary."""
    job_dirs = [path.parent.parent for path in sweep_dir.glob(f"*/{HYDRA_CONFIG}")]
    return [
        JobSummary.read(job) if (job / SUMMARY_FILE).exists() else JobSummary.missing(job)
        for job in sorted(job_dirs, key=_job_order)
    ]


def _job_order(job_dir: Path) -> tuple[int, str]:
    # Hydra numbers a sweep's jobs; the default subdir starts with that number.
    number, _, _ = job_dir.name.partition("-")
    return (int(number) if number.isdigit() else -1, job_dir.name)
