"""What a job's stages returned so far, and the job's record assembled from it when the job ends.

The stages (exporter/job/stages.py) are functions of the values before them; the sequence that
calls them keeps each value here as it comes, so that a job that fails or is stopped at a stage
still ends with what the stages before it made. Data only: it imports no torch, so the job's
frame can hold one before the stages are imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from exporter.tracking.record import JobRecord

if TYPE_CHECKING:
    from exporter.artifact import Artifact
    from exporter.audit import WeightsAudit
    from exporter.benchmark import Benchmark
    from exporter.export import Diagnosis
    from exporter.localize import Localization
    from exporter.localize.repair import Repair
    from exporter.quantize import Quantization
    from exporter.quantize.attribution import Attribution
    from exporter.quantize.verdict import Quality
    from exporter.validate import Report
    from runtimes.formats.bundle import Bundle


@dataclass
class CacheUse:
    """Per cached stage (export, goldens, lower): its cache key, noted before its work starts,
    and whether its work came from the cache, noted once the cache answered (absent with the
    cache off)."""

    keys: dict[str, str] = field(default_factory=dict)
    hits: dict[str, bool] = field(default_factory=dict)


@dataclass
class Produced:
    """The stages' values so far, set by the sequence that calls them (exporter/job/stages.py),
    never by a stage itself; the job's record takes them when the job ends (`into`)."""

    # The model's parameters and buffers, each storage counted once.
    weight_bytes: int | None = None
    # Why torch.export failed: the job's error, or with export.on_failure=draft, its warning.
    diagnosis: Diagnosis | None = None
    # What the quantize stage made of the model (None: float); the verdict then judges the
    # artifact against the quantized model (fidelity).
    quantization: Quantization | None = None
    cache: CacheUse = field(default_factory=CacheUse)
    artifact: Artifact | None = None
    bundle: Bundle | None = None
    # The artifact's constants checked against the model's weights, then its outputs judged
    # at every live shape: the validate stage's two findings, the audit's kept where running
    # the artifact then fails.
    weights_audit: WeightsAudit | None = None
    report: Report | None = None
    localization: Localization | None = None
    repair: Repair | None = None
    benchmark: Benchmark | None = None
    # A quantized model: what quantization costs (the artifact against the float model), judged
    # apart from the artifact's fidelity, and which layers cost the most
    # (quantize.attribution).
    quality: Quality | None = None
    attribution: Attribution | None = None

    @property
    def passed(self) -> bool:
        """Whether the artifact validated: its outputs within the rule and its constants the
        model's."""
        audit, report = self.weights_audit, self.report
        return audit is not None and audit.passed and report is not None and report.passed

    def into(self, record: JobRecord) -> None:
        """The job's record gets what the stages made: its summary, MLflow run and the
        sweep's comparison read it there."""
        record.weight_bytes = self.weight_bytes
        record.diagnosis = self.diagnosis
        record.cache_keys = dict(self.cache.keys)
        record.cache_hits = dict(self.cache.hits)
        record.artifact = self.artifact
        record.bundle = self.bundle
        record.weights_audit = self.weights_audit
        record.report = self.report
        record.localization = self.localization
        record.repair = self.repair
        record.benchmark = self.benchmark
        record.quantization = self.quantization
        record.quality = self.quality
        record.attribution = self.attribution
