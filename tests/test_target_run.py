"""`python -m exporter track report=PATH`: a target's check of a job's bundle, attached to the
job's MLflow run as a child run, with the job's metrics at the same steps."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from exporter.tracking.runs import PER_SHAPE_METRICS
from tests.conftest import PROJECT_ROOT, mlflow_runs, run_command, tracking_uri_in

# The track command's run on the check's report, and the child run it made.
Attached = tuple[subprocess.CompletedProcess[str], Run]

MLP_JOB = ("model=mlp", "backend=executorch", "benchmark=off", "validate.localize=off")


@dataclass(frozen=True)
class Checked:
    """A job's run and bundle, and a target's check of it."""

    workdir: Path
    job_run: Run
    bundle: Path
    report_path: Path
    check_exit_code: int

    @property
    def tracking_uri(self) -> str:
        return tracking_uri_in(self.workdir)

    def report(self) -> dict:
        return json.loads(self.report_path.read_text())

    def children(self) -> list[Run]:
        parent = self.job_run.info.run_id
        return [r for r in mlflow_runs(self.tracking_uri) if _parent(r) == parent]


def _parent(run: Run) -> str | None:
    return run.data.tags.get(MLFLOW_PARENT_RUN_ID)


def run_job_and_check(workdir: Path, name: str) -> Checked:
    """A job in `workdir/name`, then `python -m runtimes.check` of its bundle, in processes of
    their own."""
    run_dir = workdir / name
    before = {r.info.run_id for r in mlflow_runs(tracking_uri_in(workdir))}
    job = run_command(workdir, f"hydra.run.dir={run_dir}", *MLP_JOB)
    (job_run,) = [r for r in mlflow_runs(tracking_uri_in(workdir)) if r.info.run_id not in before]
    assert (run_dir / "bundle").is_dir(), job.stdout + job.stderr
    return check(workdir, job_run, run_dir / "bundle", name)


def check(workdir: Path, job_run: Run, bundle: Path, name: str, *flags: str) -> Checked:
    """`python -m runtimes.check BUNDLE FLAGS...`, its report written into `workdir/name-target`
    as on another machine."""
    report_path = workdir / f"{name}-target" / "report.json"
    completed = subprocess.run(
        [sys.executable, "-m", "runtimes.check", str(bundle), "--report", report_path, *flags],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert report_path.is_file(), completed.stdout + completed.stderr
    return Checked(workdir, job_run, bundle, report_path, completed.returncode)


def track(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", "track", *arguments],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("target_run")


@pytest.fixture(scope="module")
def checked(workdir: Path) -> Checked:
    return run_job_and_check(workdir, "job")


@pytest.fixture(scope="module")
def attached(checked: Checked) -> Attached:
    """The check's report attached once; the command and the child run it made."""
    completed = track(f"report={checked.report_path}")
    (child,) = checked.children()
    return completed, child


def test_a_target_run_is_nested_under_the_job_with_its_figures(
    checked: Checked, attached: Attached
) -> None:
    completed, child = attached
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert checked.check_exit_code == 0
    parent = checked.job_run
    for named in (child.info.run_id, parent.info.run_id, checked.tracking_uri, "mlflow ui"):
        assert named in output
    report = checked.report()
    check = report["check"]
    assert child.info.status == "FINISHED"
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.info.run_name == f"mlp-executorch @ {check['host']} ({check['device']})"
    tags = child.data.tags
    assert tags[MLFLOW_PARENT_RUN_ID] == parent.info.run_id
    assert tags["target.device"] == check["device"] == "cpu"
    assert tags["target.host"] == check["host"]
    assert tags["target.runtime"] == "executorch"
    assert (tags["status"], tags["exit_code"]) == ("passed", "0")
    for group in ("model", "backend", "dynamic", "validate"):
        assert tags[group] == parent.data.tags[group]
    assert (tags["model"], tags["backend"]) == ("mlp", "executorch")

    client = MlflowClient(checked.tracking_uri)
    shapes = report["shapes"]
    sizes = [shape["shape"]["batch"] for shape in shapes]
    for metric, stat in PER_SHAPE_METRICS.items():
        history = client.get_metric_history(child.info.run_id, metric)
        # An MLP has no next-token logits: what they predict is not measured, nor logged.
        expected = [
            (size, shape[stat])
            for size, shape in zip(sizes, shapes, strict=True)
            if shape[stat] != "nan"
        ]
        assert [(m.step, m.value) for m in history] == expected
        on_job = client.get_metric_history(parent.info.run_id, metric)
        assert [m.step for m in on_job] == [size for size, _ in expected]
    metrics = child.data.metrics
    assert metrics["worst_max_abs_err"] == max(shape["max_abs"] for shape in shapes)
    assert metrics["worst_nrmse"] == max(shape["nrmse"] for shape in shapes)
    assert metrics["check_s"] == check["seconds"]
    # The job's validation figures, under the same names: MLflow compares them side by side.
    assert set(metrics) - {"check_s"} <= set(parent.data.metrics)

    (logged,) = client.list_artifacts(child.info.run_id)
    assert logged.path == "report.json"
    downloaded = client.download_artifacts(child.info.run_id, "report.json", str(checked.workdir))
    assert json.loads(Path(downloaded).read_text()) == report


def test_attaching_a_report_again_makes_no_second_run(checked: Checked, attached: Attached) -> None:
    _, child = attached
    before = [run.info.run_id for run in checked.children()]
    again = track(f"report={checked.report_path}", f"mlflow.tracking_uri={checked.tracking_uri}")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "attached before" in again.stdout
    assert child.info.run_id in again.stdout
    assert [run.info.run_id for run in checked.children()] == before
    assert child.info.run_id in before


def test_a_failed_check_is_a_failed_run(checked: Checked, attached: Attached) -> None:
    # The job's bundle under a stricter rule, which a target judges by as the manifest gives it:
    # some shapes' errors are up to 2.6 times eager's at float32, and factor 1 fails them.
    bundle = Path(shutil.copytree(checked.bundle, checked.workdir / "strict-bundle"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tolerances"].update(factor=1.0, floor=0.0)
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    strict = check(checked.workdir, checked.job_run, bundle, "strict")
    assert strict.check_exit_code == 1
    completed = track(f"report={strict.report_path}")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "failed (exit code 1)" in completed.stdout
    sha = hashlib.sha256(strict.report_path.read_bytes()).hexdigest()
    (child,) = [r for r in checked.children() if r.data.tags.get("target.report_sha256") == sha]
    assert child.info.status == "FAILED"
    assert (child.data.tags["status"], child.data.tags["exit_code"]) == ("failed", "1")
    # The run's figures are the worst over the live shapes that measured them, whichever shape
    # that is on this CPU (an Intel Xeon's first shape needs factor 1.278, its worst 1.638);
    # each shape's error ratio is at its step.
    measured = [shape for shape in strict.report()["shapes"] if shape["ratio"] != "nan"]
    metrics = child.data.metrics
    assert metrics["worst_error_ratio"] == max(shape["ratio"] for shape in measured) > 1
    assert metrics["needed_factor"] == max(shape["needed_factor"] for shape in measured) > 1
    ratios = MlflowClient(checked.tracking_uri).get_metric_history(child.info.run_id, "error_ratio")
    assert [(m.step, m.value) for m in ratios] == [
        (shape["shape"]["batch"], shape["ratio"]) for shape in measured
    ]


def test_a_check_that_could_not_run_the_artifact_is_a_failed_run(
    checked: Checked, attached: Attached
) -> None:
    # XNNPACK's program runs on the CPU only: on cuda the check cannot load it (exit code 5).
    on_cuda = check(checked.workdir, checked.job_run, checked.bundle, "cuda", "--device", "cuda")
    assert on_cuda.check_exit_code == 5
    completed = track(f"report={on_cuda.report_path}")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "failed (exit code 5)" in completed.stdout
    child = next(r for r in checked.children() if r.data.tags["target.device"] == "cuda")
    assert child.info.status == "FAILED"
    assert (child.data.tags["status"], child.data.tags["exit_code"]) == ("failed", "5")
    assert "runs on the CPU, not on cuda" in child.data.tags["error"]
    assert child.info.run_name.endswith("(cuda)")
    # It has no report of shapes, only how long the check took.
    assert set(child.data.metrics) == {"check_s"}


def _with_source_run(checked: Checked, run_id: str | None, name: str) -> Path:
    """A copy of the target's report whose bundle came from the run `run_id` (None: from a job
    with mlflow=off)."""
    payload = checked.report()
    payload["check"]["source"]["run_id"] = run_id
    path = checked.workdir / name
    path.write_text(json.dumps(payload))
    return path


def test_a_store_that_cannot_be_written_exits_7_and_a_retry_attaches(
    checked: Checked, attached: Attached
) -> None:
    # A report not attached yet: the same figures, other bytes.
    report = _with_source_run(checked, checked.job_run.info.run_id, "retried.json")
    artifacts = checked.workdir / "mlartifacts"
    kept = artifacts.rename(checked.workdir / "mlartifacts.kept")
    # The experiment's artifact folder is a file now: the child's report.json cannot be logged.
    artifacts.write_text("not a folder")
    try:
        failed = track(f"report={report}")
    finally:
        artifacts.unlink()
        kept.rename(artifacts)
    output = failed.stdout + failed.stderr
    assert failed.returncode == 7, output
    assert "could not be written" in output and str(report) in output
    assert "Traceback" not in output
    (half_written,) = [r for r in checked.children() if r.data.tags["status"] == "running"]
    assert half_written.info.status == "FAILED"
    assert half_written.info.run_id in output

    retried = track(f"report={report}")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert "attached:" in retried.stdout
    sha = [r.data.tags.get("target.report_sha256") for r in checked.children()]
    assert sha.count(hashlib.sha256(report.read_bytes()).hexdigest()) == 1


def _missing(c: Checked) -> tuple[list[str], list[str]]:
    return ["report=/no/such/report.json"], ["report=/no/such/report.json", "cannot be read"]


def _job_report(c: Checked) -> tuple[list[str], list[str]]:
    path = c.workdir / "job" / "report.json"
    return [f"report={path}"], [str(path), "no `check` section"]


def _unknown_key(c: Checked) -> tuple[list[str], list[str]]:
    return [f"report={c.report_path}", "foo=1"], ["`foo`", "report, mlflow.tracking_uri"]


def _no_equals(c: Checked) -> tuple[list[str], list[str]]:
    return [str(c.report_path)], [str(c.report_path), "is not key=value"]


def _no_report(c: Checked) -> tuple[list[str], list[str]]:
    return [f"mlflow.tracking_uri={c.tracking_uri}"], ["report= is required"]


def _mlflow_off(c: Checked) -> tuple[list[str], list[str]]:
    path = _with_source_run(c, None, "off.json")
    return [f"report={path}"], [str(path), "mlflow=off"]


def _run_elsewhere(c: Checked) -> tuple[list[str], list[str]]:
    path = _with_source_run(c, "0" * 32, "elsewhere.json")
    return [f"report={path}"], [
        "0" * 32,
        f"not in the store at mlflow.tracking_uri={c.tracking_uri}",
    ]


@pytest.mark.parametrize(
    "bad_input",
    [_missing, _job_report, _unknown_key, _no_equals, _no_report, _mlflow_off, _run_elsewhere],
)
def test_bad_input_exits_2_naming_it(
    checked: Checked,
    attached: Attached,
    bad_input: Callable[[Checked], tuple[list[str], list[str]]],
) -> None:
    arguments, named = bad_input(checked)
    before = len(checked.children())
    completed = track(*arguments)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    for text in named:
        assert text in output
    assert "Traceback" not in output
    assert len(checked.children()) == before
