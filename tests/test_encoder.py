"""model=encoder end to end: a model of two dynamic dims is validated at every corner of them,
and MLflow gets one step per live shape, each named by a tag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from exporter.models import DynamicDim
from exporter.validate.plan import plan
from runtimes.verdict.shapes import label
from tests.conftest import CliResult, job_in_process, run_exporter

CORNERS = [
    {"batch": 1, "seq": 1},
    {"batch": 1, "seq": 64},
    {"batch": 8, "seq": 1},
    {"batch": 8, "seq": 64},
]


def planned_shapes(result: CliResult) -> list[dict[str, int]]:
    return [entry["shape"] for entry in result.report()["shapes"]]


@pytest.fixture(scope="module")
def encoder_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return run_exporter(tmp_path_factory.mktemp("encoder"), "model=encoder", "backend=executorch")


def test_encoder_on_executorch_passes_at_every_corner_and_the_diagonal(
    encoder_job: CliResult,
) -> None:
    assert encoder_job.exit_code == 0, encoder_job.output
    shapes = planned_shapes(encoder_job)
    batch = DynamicDim("batch", (("x", 0),), 1, 8)
    seq = DynamicDim("seq", (("x", 1),), 1, 64)
    assert shapes == plan([batch, seq], [], 2, seed=0)
    assert all(corner in shapes for corner in CORNERS)
    # The diagonal: min, min+1, the odd middle, max-1 of both dims together.
    assert all({"batch": b, "seq": s} in shapes for b, s in ((1, 1), (2, 2), (5, 33), (7, 63)))
    report = encoder_job.report()
    assert report["passed"]
    assert all(entry["max_abs"] < 1e-5 for entry in report["shapes"])
    outputs = [output for execution in report["executions"] for output in execution["outputs"]]
    assert {(o["dtype"], o["expected_dtype"]) for o in outputs} == {("float32", "float32")}
    # Only the LayerNorms stay off XNNPACK: attention is bmm and softmax, which it takes.
    partition = json.loads((encoder_job.run_dir / "partition.json").read_text())
    assert partition["ops_outside"] == {"aten.native_layer_norm.default": 2}


def test_encoder_run_has_one_step_per_live_shape_each_named_by_a_tag(
    encoder_job: CliResult,
) -> None:
    (run,) = encoder_job.mlflow_runs()
    assert run.info.status == "FINISHED"
    shapes = planned_shapes(encoder_job)
    client = MlflowClient(encoder_job.tracking_uri)
    for key in ("max_abs_err", "max_rel_err", "nrmse", "latency_ms"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(metric.step for metric in history) == list(range(len(shapes)))
    step_tags = {key: value for key, value in run.data.tags.items() if key.startswith("step.")}
    assert step_tags == {f"step.{n}": label(shape) for n, shape in enumerate(shapes)}
    assert step_tags["step.0"] == "batch=1,seq=1"
    assert step_tags[f"step.{len(shapes) - 1}"] == "batch=8,seq=64"
    summary = json.loads((encoder_job.run_dir / "summary.json").read_text())
    # The comparison places each shape by its sizes, one panel per dim.
    assert summary["shapes"] == shapes


def test_encoder_on_the_eager_backend_passes_at_every_corner(tmp_path: Path) -> None:
    # What eager's stages compute, in this process: a job process's start would be most of it.
    record, report = job_in_process(tmp_path, "model=encoder", "backend=eager")
    assert record.exit_code == 0, record.error
    shapes = [entry["shape"] for entry in report["shapes"]]
    assert all(corner in shapes for corner in CORNERS)
    assert report["passed"] and all(execution["passed"] for execution in report["executions"])
