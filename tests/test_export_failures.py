"""Failed exports explain themselves: the kind of failure, the model line, the fix, exit 3."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from exporter.export import Diagnosis, ExportDiagnosed
from tests.conftest import CliResult, job_in_process

MODELS = Path(__file__).with_name("failing_models.py")


def line_of(marker: str) -> str:
    """`file:line` of the model line holding `marker`, as the diagnosis names it."""
    lines = MODELS.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if marker in line)
    return f"{MODELS}:{number}"


def custom(factory: str, *overrides: str) -> list[str]:
    return ["model=custom", f"model.factory=tests.failing_models:{factory}", *overrides]


def export_report(result: CliResult) -> dict:
    return json.loads((result.run_dir / "export_report.json").read_text())


def assert_export_failed(result: CliResult, *phrases: str) -> dict:
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    for phrase in phrases:
        assert phrase in result.output, result.output
        assert phrase in (result.run_dir / "export_report.txt").read_text()
    (run,) = result.mlflow_runs()
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "export")
    files = {a.path for a in MlflowClient(result.tracking_uri).list_artifacts(run.info.run_id)}
    assert {"export_report.json", "export_report.txt"} <= files
    assert not (result.run_dir / "program.pt2").exists()
    return run.data.tags


def test_branching_on_a_tensor_value_names_the_line_and_the_fix(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("branch_on_value"), "backend=eager")
    tags = assert_export_failed(
        result,
        "[data-dependent error]",
        f"at {line_of('data-dependent diagnosis')}: if x.sum() > 0:",
        "torch.cond(pred, true_fn, false_fn, operands)",
        "torch._check(",
    )
    assert tags["export.failure_kinds"] == "data-dependent error"
    (failure,) = export_report(result)["failures"]
    assert failure["kind"] == "data-dependent error"
    assert failure["location"]["code"].startswith("if x.sum() > 0:")
    # torch.export's own print of the graph it traced goes to the report, not the terminal.
    assert "aten.sum.default" in export_report(result)["partial_graph"]
    assert "def forward(self" not in result.output


class TraceRecords(logging.Handler):
    """Counts the records of torch's structured trace by their kind."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.kinds: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for kind in getattr(record, "metadata", {}):
            self.kinds[kind] = self.kinds.get(kind, 0) + 1


def test_the_diagnosis_takes_no_stack_of_each_symbolic_expression(tmp_path: Path) -> None:
    """draft_export would record every expression torch creates with its stacks (dozens for this
    model, about 24,000 for a tiny ConvNeXt); the diagnosis reads only the failures, which it
    still finds with their line."""
    records = TraceRecords()
    trace = logging.getLogger("torch.__trace")
    trace.addHandler(records)
    try:
        with pytest.raises(ExportDiagnosed) as failed:
            job_in_process(tmp_path / "run", *custom("branch_on_value"), "backend=eager")
    finally:
        trace.removeHandler(records)
    (failure,) = failed.value.diagnosis.failures
    assert failure.kind == "data-dependent error"
    assert failure.location is not None and failure.location.code.startswith("if x.sum() > 0:")
    assert records.kinds.get("propagate_real_tensors_provenance", 0) > 0, records.kinds
    assert records.kinds.get("expression_created", 0) == 0, records.kinds


def test_a_dim_the_model_specializes_exits_3_naming_the_dim_its_value_and_the_line(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("fixed_batch"), "backend=eager")
    tags = assert_export_failed(
        result,
        "[specialized dim] batch (declared 1..64) was specialized to the constant 64",
        f"at {line_of('specialization diagnosis')}: return x + self.bias",
        "dynamic.batch.min=64 dynamic.batch.max=64",
    )
    assert tags["export.failure_kinds"] == "specialized dim"
    (failure,) = export_report(result)["failures"]
    assert (failure["kind"], failure["dims"]) == ("specialized dim", ["batch"])


def test_a_dim_the_model_narrows_exits_3_with_the_bounds_that_would_hold(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("narrow_batch"), "backend=eager")
    assert_export_failed(
        result,
        "batch (declared 1..64) was narrowed to 33..64",
        f"at {line_of('narrowing diagnosis')}: if x.shape[0] > 32:",
        "dynamic.batch.min=33 dynamic.batch.max=64",
    )


def test_an_unbacked_dim_a_runtime_assert_pins_is_a_specialization_too(
    exporter_cli: Callable[..., CliResult],
) -> None:
    # Unbacked, nothing guards on batch: torch.export succeeds with an assert that batch == 64.
    result = exporter_cli(*custom("fixed_batch", "dynamic.batch.mode=unbacked", "backend=eager"))
    assert_export_failed(
        result,
        "batch (declared 1..64) was specialized to the constant 64",
        f"at {line_of('specialization diagnosis')}: return x + self.bias",
    )


def test_on_failure_draft_goes_on_with_the_draft_program_tagged_as_such(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(
        *custom("branch_always_taken", "backend=eager", "export.on_failure=draft")
    )
    assert result.exit_code == 0, result.output
    assert "export.on_failure=draft: the job goes on with draft_export's program" in result.output
    report = export_report(result)
    assert report["continued_with_draft"] is True
    assert report["kinds"] == ["data-dependent error"]
    # A later job that takes this program from the cache reads the same diagnosis back.
    diagnosis = Diagnosis.read(result.run_dir)
    assert diagnosis is not None and diagnosis.continued_with_draft
    assert diagnosis.text() + "\n" == (result.run_dir / "export_report.txt").read_text()
    (run,) = result.mlflow_runs()
    assert run.info.status == "FINISHED"
    assert run.data.tags["export.draft"] == "true"
    assert run.data.tags["export.failure_kinds"] == "data-dependent error"
    assert run.data.metrics["worst_max_abs_err"] < 1e-6
    assert result.report()["passed"]


# What export and validation compute, in the test's process: it skips a job process's start.
def test_unbacked_dims_export_without_a_size_hint_and_validate_like_backed_ones(
    tmp_path: Path,
) -> None:
    record, report = job_in_process(
        tmp_path, "model=mlp", "backend=eager", "dynamic.batch.mode=unbacked"
    )
    assert record.exit_code == 0, record.error
    program = torch.export.load(tmp_path / "program.pt2")
    ranges = {str(symbol): (r.lower, r.upper) for symbol, r in program.range_constraints.items()}
    assert ranges == {"u0": (1, 64)}
    assert report["passed"]
    assert [s["shape"]["batch"] for s in report["shapes"]] == [1, 2, 33, 50, 54, 63, 64]


def test_llama_with_an_unbacked_seq_is_told_which_library_line_guards_on_it(
    exporter_cli: Callable[..., CliResult],
) -> None:
    # One decoder layer: the first guards on seq as each of them would. No MLflow run is judged
    # here: the job's process starts without importing MLflow.
    result = exporter_cli(
        "model=llama",
        "model.num_hidden_layers=1",
        "dynamic.seq.mode=unbacked",
        "backend=eager",
        "mlflow=off",
    )
    assert result.exit_code == 3, result.output
    (failure,) = export_report(result)["failures"]
    assert failure["kind"] == "data-dependent error"
    assert "/transformers/" in failure["location"]["file"]
    assert "set dynamic.seq.mode=backed" in failure["fix"]
    assert "[data-dependent error]" in result.output
