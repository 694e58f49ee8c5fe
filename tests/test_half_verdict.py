"""The verdict on half-precision causal LMs: what their next-token logits predict against the
float64 oracle, beside eager's at the model's dtype (report.json, and MLflow and the terminal of
the real command judging the artifact), and the default half rule, which passes a correct float16
artifact that the values alone fail and still fails a planted fault."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from exporter import config, models
from runtimes import load
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.report import Report
from runtimes.verdict.shapes import label
from tests.conftest import (
    CONF_DIR,
    CliResult,
    job_in_process,
    mlflow_runs,
    run_command,
    tracking_uri_in,
)

FLOAT16 = ("model.dtype=float16", "backend=executorch")
# One decoder layer: the verdict is on the logits, and lowering costs ~11 s a layer.
FLOAT16_LLAMA = ("model=llama", "model.num_hidden_layers=1", *FLOAT16)


def job(workdir: Path, name: str, *overrides: str) -> CliResult:
    """One command's job of the test's store and cache, in a run dir of its own."""
    run_dir = workdir / name
    completed: subprocess.CompletedProcess[str] = run_command(
        workdir, f"hydra.run.dir={run_dir}", "validate.localize=off", "benchmark=off", *overrides
    )
    output = completed.stdout + completed.stderr
    return CliResult(completed.returncode, output, run_dir, tracking_uri_in(workdir))


@dataclass
class Built:
    """The float16 Llama's artifact, made by a job in the test's process into the cache that the
    commands of `workdir` use: they judge it with the exported program and goldens it made."""

    workdir: Path
    run_dir: Path
    report: dict

    @property
    def artifact(self) -> str:
        return f"artifact={self.run_dir / 'model.pte'}"


@pytest.fixture(scope="module")
def float16_llama(tmp_path_factory: pytest.TempPathFactory) -> Built:
    workdir = tmp_path_factory.mktemp("half")
    run_dir = workdir / "built"
    record, report = job_in_process(run_dir, *FLOAT16_LLAMA, cache_dir=workdir / "cache")
    # Where XNNPACK sums float16 products in float16 (a CPU with float16 arithmetic), the
    # artifact is less accurate than eager, which sums in float32, beyond the default rule.
    assert record.exit_code == (1 if sums_in_float16(report) else 0), record.error
    return Built(workdir, run_dir, report)


def sums_in_float16(report: dict) -> bool:
    """Whether the report's runtime measured its CPU summing float16 products in float16."""
    return report["target"]["float16_sums"].startswith("float16")


# Factor 1: any shape whose error exceeds eager's by a hair fails by its values alone.
TIGHT = (*FLOAT16_LLAMA, "validate.factor=1", "validate.floor=0")


@pytest.fixture(scope="module")
def judged_by_distribution(float16_llama: Built) -> CliResult:
    """The artifact judged by the command at factor 1, tracked to MLflow."""
    return job(float16_llama.workdir, "distribution", *TIGHT, float16_llama.artifact)


def _predictions(logits: torch.Tensor, golden: torch.Tensor) -> tuple[float, float, float]:
    """Top-1 agreement and the mean and largest KL(golden || logits), computed here with
    torch's own kl_div."""
    vocab = golden.shape[-1]
    ours = torch.log_softmax(logits.double().reshape(-1, vocab), dim=-1)
    theirs = torch.log_softmax(golden.double().reshape(-1, vocab), dim=-1)
    divergence = torch.nn.functional.kl_div(ours, theirs, log_target=True, reduction="none")
    per_position = divergence.sum(dim=-1)
    top1 = (ours.argmax(dim=-1) == theirs.argmax(dim=-1)).double().mean()
    return top1.item(), per_position.mean().item(), per_position.max().item()


def test_the_report_and_mlflow_give_next_token_agreement_and_kl_as_computed_directly(
    float16_llama: Built, judged_by_distribution: CliResult
) -> None:
    report = float16_llama.report
    goldens = stored_goldens.load(float16_llama.run_dir / "bundle")
    artifact = load(float16_llama.run_dir / "model.pte", "executorch", "cpu")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        composed = config.to_job(compose("config", list(FLOAT16_LLAMA)))
    eager = models.build(composed.model, composed.dynamic)
    for shape in report["shapes"]:
        inputs, (golden,) = goldens.cases[label(shape["shape"])]
        with torch.no_grad():
            reference = eager.module(*inputs)
        for prefix, logits in (("", artifact.run(inputs)[0]), ("ref_", reference)):
            top1, kl_mean, kl_max = _predictions(logits, golden)
            assert shape[f"{prefix}top1"] == pytest.approx(top1, abs=1e-12)
            assert shape[f"{prefix}kl_mean"] == pytest.approx(kl_mean, rel=1e-6)
            assert shape[f"{prefix}kl_max"] == pytest.approx(kl_max, rel=1e-6)
        # float16 rounding, not a changed prediction: far below a nat.
        assert 0 < shape["kl_mean"] < 1e-6
    # The command that judged the same artifact on the same goldens reports the same figures,
    # and logs them to its MLflow run.
    judged = judged_by_distribution.report()["shapes"]
    keys = ("shape", "top1", "kl_mean", "kl_max", "ref_top1", "ref_kl_mean", "ref_kl_max")
    assert [{k: s[k] for k in keys} for s in judged] == [
        {k: s[k] for k in keys} for s in report["shapes"]
    ]
    (run,) = mlflow_runs(judged_by_distribution.tracking_uri)
    assert run.data.metrics["worst_top1_agreement"] == min(shape["top1"] for shape in judged)
    # On what the verdict holds: the CPU and how its runtime summed float16, measured.
    target = judged_by_distribution.report()["target"]
    assert target == report["target"]
    assert target["float16_sums"].split()[0] in ("float16", "float32")
    assert {key: run.data.tags[f"target.{key}"] for key in target} == target
    history = {
        metric.step: metric.value
        for metric in run_history(
            judged_by_distribution.tracking_uri, run.info.run_id, "ref_kl_mean"
        )
    }
    assert history == {shape["shape"]["seq"]: shape["ref_kl_mean"] for shape in judged}


def run_history(tracking_uri: str, run_id: str, key: str) -> list:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri).get_metric_history(run_id, key)


def test_a_correct_float16_artifact_beyond_the_factor_passes_by_its_predictions_not_strictly(
    float16_llama: Built, judged_by_distribution: CliResult
) -> None:
    if sums_in_float16(float16_llama.report):
        # The verdict holds for this CPU's arithmetic, and says so beside the failure.
        failed = judged_by_distribution
        assert failed.exit_code == 1, failed.output
        assert "sums float16 products in float16" in failed.output
        assert "float16 products summed in float16" in failed.output
        return
    passed = judged_by_distribution
    assert passed.exit_code == 0, passed.output
    assert "float16 products summed in float32" in passed.output
    shapes = passed.report()["shapes"]
    by_distribution = [shape for shape in shapes if shape["by_distribution"]]
    assert by_distribution and all(shape["passed"] for shape in shapes)
    assert all(float(shape["ratio"]) > 1 for shape in by_distribution)
    assert "predict the next token as eager does" in passed.output

    strict = job(
        float16_llama.workdir, "strict", *TIGHT, float16_llama.artifact, "validate.half=strict"
    )
    assert strict.exit_code == 1, strict.output
    failed = [shape for shape in strict.report()["shapes"] if not shape["passed"]]
    assert len(failed) == len(by_distribution)
    assert "Next-token predictions against the float64 oracle" in strict.output
    # The backend's measured half-precision arithmetic, stated beside the failure.
    assert "rounded to float16 between them" in strict.output
    # Where its CPU sums float16 in float16, the failure says the verdict holds for that
    # arithmetic (the same report, as a CPU with float16 arithmetic would measure it).
    assert "sums float16 products in float16" not in strict.output
    natively = strict.report()
    natively["target"] |= {"float16_sums": "float16 (a dot product off by 161 ulp)"}
    assert "sums float16 products in float16" in Report.from_json(natively).failure_message()


def test_a_float16_llama_whose_output_projection_is_scaled_by_1_01_still_fails(
    tmp_path: Path,
) -> None:
    # In this process: the verdict is the point, and the command that states it is above.
    record, report = job_in_process(
        tmp_path / "planted",
        "model=custom",
        "model.factory=tests.failing_models:llama_scaled_when_exported",
        "+model.options.module=lm_head",
        "+model.options.layers=1",
        "dynamic=llama",
        *FLOAT16,
        "validate.localize=off",
    )
    assert record.exit_code == 1, record.error
    assert report["weights_audit"]["mismatched"] == []
    shapes = report["shapes"]
    # Every top token may be eager's; the distributions are far beyond eager's own divergence.
    assert all(float(shape["kl_mean"]) > 8 * float(shape["ref_kl_mean"]) for shape in shapes)
    assert not any(shape["by_distribution"] for shape in shapes)
