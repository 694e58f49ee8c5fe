"""Every job writes bundle/ into its run dir; `python -m runtimes.check BUNDLE` validates it on a
target that has none of the exporter, transformers, Hydra or MLflow (tests/bare_target.py makes
them unimportable), and exits 2 naming a file that is missing or changed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import PROJECT_ROOT, CliResult, job_in_process, run_exporter

# What a bare target lacks: the check must run without any of them.
NOT_ON_TARGET = "exporter,transformers,hydra,omegaconf,mlflow"
# The WebGPU runtime needs neither ExecuTorch nor the exporter's table and progress libraries.
NOT_ON_WEBGPU_TARGET = f"{NOT_ON_TARGET},executorch,tabulate,tqdm"


def check(
    bundle: Path, report: Path, *args: str, blocked: str = NOT_ON_TARGET
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "tests/bare_target.py",
            blocked,
            "runtimes.check",
            str(bundle),
            "--report",
            str(report),
            *args,
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def mlp_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    result = run_exporter(tmp_path_factory.mktemp("mlp"), "model=mlp", "benchmark=off")
    assert result.exit_code == 0, result.output
    return result


def cache_of(job: CliResult) -> Path:
    """`job`'s cache: a job that differs from it only where no cache key looks (tolerances, the
    bundle) reuses its export, goldens and lowering."""
    return job.run_dir.parent / "cache"


@pytest.fixture
def copied(mlp_job: CliResult, tmp_path: Path) -> Path:
    """The mlp job's bundle copied as a user would to a target (files, not links)."""
    return Path(shutil.copytree(mlp_job.run_dir / "bundle", tmp_path / "bundle"))


def per_shape(report: dict, stat: str) -> list[float]:
    return [shape[stat] for shape in report["shapes"]]


def test_an_executorch_bundle_checks_without_the_exporter_and_matches_the_job(
    mlp_job: CliResult, tmp_path: Path
) -> None:
    bundle = mlp_job.run_dir / "bundle"
    # By link, not a copy: the bundle's artifact is the run dir's file.
    assert (bundle / "model.pte").stat().st_ino == (mlp_job.run_dir / "model.pte").stat().st_ino
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["goldens.pt", "model.pte"]
    assert (manifest["runtime"], manifest["device"], manifest["artifact"]) == (
        "executorch",
        "cpu",
        "model.pte",
    )
    assert len(manifest["shapes"]) == 7
    assert len(manifest["executions"]) == 14
    assert manifest["executions"][-1] == [manifest["shapes"][0], "new instance"]

    completed = check(bundle, tmp_path / "report.json")

    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "passed at all 7 live shapes" in completed.stdout
    # ExecuTorch's C++ log lines go beside the report, not to the terminal.
    assert "cpuinfo_utils.cpp" not in completed.stdout + completed.stderr
    assert "cpuinfo_utils.cpp" in (tmp_path / "native.log").read_text()
    assert "shape     runs  max_abs" in completed.stdout
    checked, job = json.loads((tmp_path / "report.json").read_text()), mlp_job.report()
    assert checked["passed"] is True
    assert [s["shape"] for s in checked["shapes"]] == [s["shape"] for s in job["shapes"]]
    # The same artifact on the same CPU, judged by the same code against the same goldens.
    assert per_shape(checked, "max_abs") == pytest.approx(per_shape(job, "max_abs"), rel=1e-3)
    assert per_shape(checked, "ref_nrmse") == per_shape(job, "ref_nrmse")
    (run,) = mlp_job.mlflow_runs()
    source = checked["check"]["source"]
    assert (source["run_id"], source["model"], source["backend"]) == (
        run.info.run_id,
        "mlp",
        "executorch",
    )
    assert (checked["check"]["runtime"], checked["check"]["device"]) == ("executorch", "cpu")
    assert checked["check"]["exit_code"] == 0
    # The versions of what the executorch runtime's loader declares it loads with.
    assert sorted(checked["check"]["packages"]) == ["executorch", "flatbuffers", "torch"]
    # The job's report says what it bundled; MLflow keeps the manifest, not a second artifact.
    assert job["bundle"]["files"] == manifest["files"]
    logged = [
        f.path for f in MlflowClient(mlp_job.tracking_uri).list_artifacts(run.info.run_id, "bundle")
    ]
    assert logged == ["bundle/manifest.json"]


def test_a_webgpu_bundle_checks_on_lavapipe_without_executorch(tmp_path: Path) -> None:
    # The job in this process: what the test runs as a command is the check.
    record, report = job_in_process(tmp_path / "run", "model=rms_norm", "backend=webgpu")
    assert record.error is None, record.error
    bundle = tmp_path / "run" / "bundle"

    completed = check(bundle, tmp_path / "report.json", blocked=NOT_ON_WEBGPU_TARGET)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    checked = json.loads((tmp_path / "report.json").read_text())
    assert checked["passed"] is True
    assert len(checked["shapes"]) == 7
    assert "llvmpipe" in checked["target"]["adapter"]
    assert checked["check"]["source"]["run_id"] is None
    assert sorted(checked["check"]["packages"]) == ["flatbuffers", "numpy", "torch", "wgpu"]
    assert per_shape(checked, "max_abs") == pytest.approx(per_shape(report, "max_abs"))


def test_a_changed_artifact_is_refused_naming_it(copied: Path, tmp_path: Path) -> None:
    pte = copied / "model.pte"
    data = bytearray(pte.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pte.write_bytes(bytes(data))

    completed = check(copied, tmp_path / "report.json")

    assert completed.returncode == 2
    assert f"{pte}: its SHA-256 does not match the bundle's manifest" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("name", ["goldens.pt", "model.pte", "manifest.json"])
def test_a_missing_file_is_refused_naming_it(copied: Path, tmp_path: Path, name: str) -> None:
    (copied / name).unlink()

    completed = check(copied, tmp_path / "report.json")

    assert completed.returncode == 2
    assert f"{copied / name}: no such file" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_a_file_copied_in_part_is_refused_with_its_size(copied: Path, tmp_path: Path) -> None:
    goldens = copied / "goldens.pt"
    size = goldens.stat().st_size
    goldens.write_bytes(goldens.read_bytes()[: size // 2])

    completed = check(copied, tmp_path / "report.json")

    assert completed.returncode == 2
    assert f"{goldens}: {size // 2} bytes where the bundle's manifest says {size}" in (
        completed.stderr
    )


def test_an_artifact_that_cannot_load_on_the_device_exits_5_with_a_report(
    mlp_job: CliResult, tmp_path: Path
) -> None:
    completed = check(mlp_job.run_dir / "bundle", tmp_path / "report.json", "--device", "cuda")

    assert completed.returncode == 5
    assert "cannot load" in completed.stderr
    assert "runs on the CPU, not on cuda" in completed.stderr
    assert "Traceback" not in completed.stderr
    checked = json.loads((tmp_path / "report.json").read_text())
    assert checked["passed"] is False
    assert (checked["check"]["exit_code"], checked["check"]["device"]) == (5, "cuda")


def test_a_failed_job_still_bundles_and_its_check_fails_alike(
    mlp_job: CliResult, tmp_path: Path
) -> None:
    """Tolerances the mlp cannot meet (factor 1 and no floor: its ratio is 2.6 at batch=1)."""
    record, report = job_in_process(
        tmp_path / "run", "model=mlp", "validate.factor=1", "validate.floor=0",
        "validate.localize=off", cache_dir=cache_of(mlp_job),
    )  # fmt: skip
    assert record.error is not None and record.error.exit_code == 1, record.error

    completed = check(tmp_path / "run" / "bundle", tmp_path / "report.json")

    assert completed.returncode == 1
    assert "FAILED: " in completed.stdout
    assert "The smallest validate.factor that would pass them all is" in completed.stdout
    checked = json.loads((tmp_path / "report.json").read_text())
    verdicts = [shape["passed"] for shape in checked["shapes"]]
    assert verdicts == [shape["passed"] for shape in report["shapes"]]
    assert False in verdicts


def test_external_weights_travel_in_the_bundle_which_writes_its_goldens_without_the_cache(
    tmp_path: Path,
) -> None:
    # With no cache_dir, the job runs with cache=false.
    record, _report = job_in_process(tmp_path / "run", "model=mlp", "backend.external_weights=true")
    assert record.error is None, record.error
    bundle = tmp_path / "run" / "bundle"
    assert sorted(p.name for p in bundle.iterdir()) == [
        "goldens.pt",
        "manifest.json",
        "model.ptd",
        "model.pte",
    ]
    # No cache to link from: the goldens are the bundle's own file.
    assert (bundle / "goldens.pt").stat().st_nlink == 1

    completed = check(bundle, tmp_path / "report.json")

    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_bundle_off_writes_none(mlp_job: CliResult, tmp_path: Path) -> None:
    record, report = job_in_process(
        tmp_path / "run", "model=mlp", "bundle=off", cache_dir=cache_of(mlp_job)
    )
    assert record.error is None, record.error
    assert not (tmp_path / "run" / "bundle").exists()
    assert "bundle" not in report


def test_a_report_that_cannot_be_written_is_exit_2_naming_where(
    mlp_job: CliResult, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("")
    completed = check(mlp_job.run_dir / "bundle", tmp_path / "a-file" / "report.json")

    assert completed.returncode == 2
    assert f"cannot write the report to {tmp_path / 'a-file' / 'report.json'}" in completed.stderr
    assert "--report PATH" in completed.stderr
    assert "Traceback" not in completed.stderr
