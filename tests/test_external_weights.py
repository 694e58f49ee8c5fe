"""backend.external_weights=true: the weights in model.ptd beside a model.pte that keeps the
program only, and the runtime loading both."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult, job_in_process, run_exporter

# One decoder layer: where the weights go does not depend on how many layers hold them.
LLAMA = ("model=llama", "model.num_hidden_layers=1")


@pytest.fixture(scope="module")
def llama_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    return run_exporter(
        tmp_path_factory.mktemp("external"),
        *LLAMA,
        "backend=executorch",
        "backend.external_weights=true",
        "mlflow=off",
    )


def test_llama_passes_with_its_weights_in_model_ptd(llama_job: CliResult) -> None:
    assert llama_job.exit_code == 0, llama_job.output
    pte, ptd = llama_job.run_dir / "model.pte", llama_job.run_dir / "model.ptd"
    # Both the constants XNNPACK serialized and those left to portable kernels (the embedding)
    # went out: what stays is the program and the delegates' graphs.
    assert pte.stat().st_size * 4 < ptd.stat().st_size, (pte.stat(), ptd.stat())
    worst = max(shape["max_abs"] for shape in llama_job.report()["shapes"])
    assert worst < 1e-5
    summary = json.loads((llama_job.run_dir / "summary.json").read_text())
    assert summary["artifact_bytes"] == pte.stat().st_size + ptd.stat().st_size


def test_the_cache_entry_holds_both_files(llama_job: CliResult) -> None:
    (manifest,) = (llama_job.run_dir.parent / "cache" / "lower").glob("*/manifest.json")
    assert set(json.loads(manifest.read_text())["files"]) >= {"model.pte", "model.ptd"}


def cache_of(job: CliResult) -> Path:
    """The job's cache: a job given its artifact takes the goldens from there."""
    return job.run_dir.parent / "cache"


def test_a_given_pte_validates_with_the_ptd_beside_it(llama_job: CliResult, tmp_path: Path) -> None:
    # Named otherwise than the job wrote them: the runtime looks for the .pte's own name.
    shutil.copy(llama_job.run_dir / "model.pte", tmp_path / "weights.pte")
    shutil.copy(llama_job.run_dir / "model.ptd", tmp_path / "weights.ptd")
    record, report = job_in_process(
        tmp_path / "run",
        *LLAMA,
        f"artifact={tmp_path / 'weights.pte'}",
        cache_dir=cache_of(llama_job),
    )
    assert record.error is None, record.error
    assert report["passed"] and len(report["shapes"]) == 7
    # The audit reads the weights where the runtime loads them, though the config did not say
    # that they lie outside the .pte (backend.external_weights is false here).
    audit = report["weights_audit"]
    assert (audit["checked"], audit["unseen"], audit["mismatched"]) == (14, [], []), audit
    assert audit["read"].endswith("in weights.ptd"), audit["read"]


def test_a_pte_without_its_ptd_is_a_runtime_error_naming_it(
    llama_job: CliResult, exporter_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    shutil.copy(llama_job.run_dir / "model.pte", tmp_path / "model.pte")
    result = exporter_cli(
        *LLAMA,
        f"artifact={tmp_path / 'model.pte'}",
        "mlflow=off",
        f"cache_dir={cache_of(llama_job)}",
    )
    assert result.exit_code == 5, result.output
    assert f"must lie beside it as model.ptd, and {tmp_path / 'model.ptd'} does not exist" in (
        result.output
    )
    assert "Traceback" not in result.output
