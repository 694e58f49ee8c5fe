"""A failure is reported by the stage where it happened: the model's own crash, its float64
oracle, a tracking store that does not answer, a key no schema has. And what the stages say
(torch.export's warnings) stays in the run dir's log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import PROJECT_ROOT, CliResult, run_exporter
from tests.test_cli import assert_user_error
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
