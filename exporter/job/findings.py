"""What the stages found about the artifact, said two ways: report.json in the run dir
(validation's report, each later stage's finding in its section) and, where validation failed,
its message, which says why in the order a user acts on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exporter import localize
from exporter.files import write_json
from exporter.localize import repair
from exporter.tracking.record import JobRecord
from runtimes.verdict.report import json_safe

REPORT_FILE = "report.json"


def write_report(run_dir: Path, record: JobRecord) -> None:
    """report.json: validation's report, and what later stages found, each in its section."""
    write_json(run_dir / REPORT_FILE, json_safe(report_payload(record)), "the report")


def report_payload(record: JobRecord) -> dict[str, Any]:
    assert record.report is not None
    sections = {
        "quantization": record.quantization and record.quantization.to_json(),
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
        "quality": record.quality and record.quality.to_json(),
        "attribution": record.attribution and record.attribution.to_json(),
    }
    return {**record.report.to_json(), **{k: v for k, v in sections.items() if v}}


def failure_message(
    record: JobRecord, keep_out: repair.KeepOut | None, backend_precision: str | None
) -> str:
    """Validation's message, with what the backend is known to lose at the model's dtype where
    values differ, then the weights that differ, then where the outputs diverge and, where that
    is one op's doing, the override that keeps the op out of the delegate."""
    report, weights_audit, localization = record.report, record.weights_audit, record.localization
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
    if record.quality is not None:
        sentences.append(f"Apart from fidelity, {record.quality.verdict()}")
    return " ".join(sentences) + f" ({REPORT_FILE} in the run dir says more.)"
