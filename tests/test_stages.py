"""A failure is reported by the stage where it happened: the model's own crash, its float64
oracle, a tracking store that does not answer, a key no schema has. What the stages say
(torch.export's warnings) stays in the run dir's log. And each stage takes the values of the
ones before, not their files: what a stopped job had stays readable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from exporter import backends, config
from exporter.job import stages
from exporter.tracking.record import JobRecord
from tests.conftest import PROJECT_ROOT, CliResult, run_exporter
from tests.test_cli import assert_user_error
from tests.test_config import composed
from tests.test_export_failures import custom


def test_a_crash_while_building_the_model_is_the_models_failure_not_the_config(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("crashes_while_built"), "backend=eager")
    assert_user_error(result, 6, "[model] RuntimeError: the model's constructor failed")
    assert "the model's constructor failed" in (result.run_dir / "traceback.txt").read_text()
    (run,) = result.mlflow_runs()
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "model")
    assert not (result.run_dir / "program.pt2").exists()


def test_an_oracle_that_cannot_run_is_the_goldens_failure_not_the_runtimes(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("refuses_float64"), "backend=eager")
    assert_user_error(
        result,
        6,
        "[goldens] the float64 oracle (the eager model in float64) could not run at batch=1",
        "this kernel has no float64 implementation",
        "No artifact was judged",
    )
    (run,) = result.mlflow_runs()
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "goldens")
    # Export ran (it comes first, and says more about a model that cannot run at a shape);
    # only the judge failed, so no report claims anything.
    assert (result.run_dir / "program.pt2").exists()
    assert not (result.run_dir / "report.json").exists()


def test_torch_exports_warnings_are_kept_in_the_run_dirs_log(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli(*custom("warns_when_traced"), "backend=eager", "mlflow=off")
    assert result.exit_code == 0, result.output
    log = (result.run_dir / "exporter.log").read_text()
    assert "a warning raised while torch.export traces the model" in log


def test_a_tracking_server_that_does_not_answer_exits_2_in_seconds(tmp_path: Path) -> None:
    start = time.perf_counter()
    result = run_exporter(tmp_path, "model=mlp", "mlflow.tracking_uri=http://127.0.0.1:9")
    seconds = time.perf_counter() - start
    assert_user_error(
        result,
        2,
        "[track] no MLflow tracking server answers at mlflow.tracking_uri=http://127.0.0.1:9",
    )
    # A guard against MLflow's own retries (about four minutes), not a speed target:
    # bench/startup.py measures it (0.4 s).
    assert seconds < 30, f"took {seconds:.1f} s"
    assert not (result.run_dir / "program.pt2").exists()


def test_mlflow_server_without_its_uri_is_a_configuration_error(tmp_path: Path) -> None:
    result = run_exporter(tmp_path, "model=mlp", "mlflow=server", "mlflow.tracking_uri=")
    assert_user_error(result, 2, "mlflow.tracking_uri is not set")


def test_a_key_no_schema_has_is_refused_naming_the_nearest_valid_key(tmp_path: Path) -> None:
    result = run_exporter(tmp_path, "+validat.atol=1")
    assert_user_error(result, 2, "unknown key +validat.atol (nearest valid key: validate.atol)")
    result = run_exporter(tmp_path, "+foo=1")
    assert_user_error(result, 2, "unknown key +foo. ")
    # Nothing ran, and a single job refused by its configuration records no MLflow run.
    assert not (result.run_dir / "program.pt2").exists()
    assert result.mlflow_runs() == []


# Makes `import mlflow` fail in every process of the job that has this folder on its path.
NO_MLFLOW = """
import sys

class NoMlflow:
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("mlflow is not installed on this target")

sys.meta_path.insert(0, NoMlflow())
"""


def test_a_job_with_mlflow_off_never_imports_mlflow(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_MLFLOW)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "exporter",
            "model=mlp",
            "backend=eager",
            "mlflow=off",
            f"cache_dir={tmp_path}/cache",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert (tmp_path / "run" / "report.json").exists()


def stages_in_process(
    run_dir: Path, notify: Callable[[str, str], None], *overrides: str
) -> tuple[JobRecord, BaseException | None]:
    """Runs one job's stages in this process with the cache in `run_dir`'s parent; the record
    of what they record, and what ended them early (None where nothing did)."""
    job = config.to_job(
        composed(
            "model=mlp", "mlflow=off", "bundle=off", f"cache_dir={run_dir.parent}/cache", *overrides
        )
    )
    run_dir.mkdir(parents=True)
    record = JobRecord(run_dir=run_dir)
    try:
        stages.run(job, backends.configured(job), record, notify)
    except (Exception, KeyboardInterrupt) as ended:
        return record, ended
    return record, None


def test_lowering_takes_the_program_the_export_stage_returned_not_the_run_dirs_file(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"

    def notify(kind: str, value: str) -> None:
        if (kind, value) == ("stage", "lower"):
            # What the export stage linked into the run dir: no later stage reads it back.
            (run_dir / "program.pt2").unlink()

    record, ended = stages_in_process(run_dir, notify, "backend=executorch", "benchmark.repeats=2")
    assert ended is None
    assert record.passed and record.benchmark is not None
    assert len(record.benchmark.shapes) == len(record.report.shapes) == 7


def test_a_job_stopped_after_validation_keeps_the_verdict_in_report_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    def notify(kind: str, value: str) -> None:
        if (kind, value) == ("stage", "benchmark"):
            raise KeyboardInterrupt

    record, ended = stages_in_process(run_dir, notify, "backend=eager")
    assert isinstance(ended, KeyboardInterrupt)
    assert record.passed and record.benchmark is None
    written = json.loads((run_dir / stages.REPORT_FILE).read_text())
    assert written["passed"] is True and "benchmark" not in written
    assert len(written["executions"]) == len(record.report.executions)
