"""backend=aoti: AOTInductor packages compiled from the exported program, validated at every
planned live shape, loadable on their own; and `backend.device`, which every backend checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mlflow.tracking import MlflowClient

from exporter import config, models
from runtimes import load
from tests.conftest import CliResult, run_exporter
from tests.test_cli import assert_user_error, planned
from tests.test_config import composed


@pytest.fixture(scope="module")
def mlp_package(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return run_exporter(tmp_path_factory.mktemp("aoti-mlp"), "model=mlp", "backend=aoti")


def test_the_mlp_package_passes_at_every_planned_size(mlp_package: CliResult) -> None:
    assert mlp_package.exit_code == 0, mlp_package.output
    report = mlp_package.report()
    assert planned(mlp_package, "batch") == [1, 2, 33, 50, 54, 63, 64]
    assert report["passed"]
    assert max(shape["max_abs"] for shape in report["shapes"]) < 1e-5
    (run,) = mlp_package.mlflow_runs()
    assert (run.info.status, run.data.tags["backend"]) == ("FINISHED", "aoti")
    assert run.data.params["backend.device"] == "cpu"
    package = mlp_package.run_dir / "model.pt2"
    assert run.data.metrics["artifact_bytes"] == package.stat().st_size
    # Inductor compiles every node: there is no partition, so no delegated fraction.
    assert "delegated_fraction" not in run.data.metrics
    artifacts = {
        a.path for a in MlflowClient(mlp_package.tracking_uri).list_artifacts(run.info.run_id)
    }
    assert {"model.pt2", "program.pt2", "report.json"} <= artifacts


def test_the_package_runs_on_its_own_at_a_size_validation_never_planned(
    mlp_package: CliResult,
) -> None:
    job = config.to_job(composed("model=mlp"))
    bundle = models.build(job.model, job.dynamic)
    (x,) = bundle.make_inputs({"batch": 5}, 7)
    (actual,) = load(mlp_package.run_dir / "model.pt2", "aoti", "cpu").run([x])
    with torch.no_grad():
        expected = bundle.module(x)
    assert actual.shape == (5, 16)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_llama_package_matches_eager_at_every_planned_size(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=llama", "backend=aoti")
    assert result.exit_code == 0, result.output
    assert planned(result, "seq") == [1, 2, 65, 99, 108, 127, 128]
    report = result.report()
    assert report["passed"]
    assert max(shape["max_abs"] for shape in report["shapes"]) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("backend", ["aoti", "eager"])
def test_cuda_on_a_machine_without_it_exits_2_before_any_work(
    exporter_cli: Callable[..., CliResult], backend: str
) -> None:
    result = exporter_cli("model=mlp", f"backend={backend}", "backend.device=cuda")
    assert_user_error(result, 2, "backend.device=cuda, but", "allowed here: backend.device=cpu")
    assert not (result.run_dir / "program.pt2").exists()


def test_executorch_runs_on_the_cpu_only(exporter_cli: Callable[..., CliResult]) -> None:
    result = exporter_cli("model=mlp", "backend.device=cuda")
    assert_user_error(result, 2, "backend.device=cuda: backend=executorch runs on cpu")


def test_an_unknown_device_is_a_configuration_error(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=mlp", "backend=aoti", "backend.device=tpu")
    assert_user_error(result, 2, "backend.device=tpu: backend=aoti runs on cpu or cuda")


@pytest.mark.slow
def test_strict_holds_for_data_dependent_ops_inductor_compiles_them(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=moe", "backend=aoti", "fallback=strict")
    assert result.exit_code == 0, result.output
    assert result.report()["passed"]
    assert not (result.run_dir / "partition.json").exists()
