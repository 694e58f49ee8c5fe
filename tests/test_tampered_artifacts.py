"""An artifact changed after lowering, validated as a user would (`artifact=...`): the weights
audit names the parameter, and localization says that lowering does not reproduce the failure.
A corrupted embedding row that no planned input reads fails the job through the audit alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CliResult, run_exporter
from tests.test_audit import DOWN_PROJ, EMBED, lowered, rewritten, tokens_validation_draws

# One decoder layer: a weight of it is as much the artifact's as any; each lowering (the job's,
# then the search's) costs less.
LLAMA = ("model=llama", "model.num_hidden_layers=1")


@pytest.fixture(scope="module")
def lowered_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The Llama's model.pte and the weights of its exported program: exported and lowered in
    this process, as a job's export and lower stages do (the commands below are the tests'
    subject, not this one's job, whose process start and validation would cost ~20 s)."""
    weights, artifact = lowered(tmp_path_factory.mktemp("llama"), "backend=executorch", *LLAMA)
    return artifact.path, weights


@pytest.fixture(scope="module")
def goldens_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for both commands: they validate the same model at the same shapes, so the
    second takes the first's goldens."""
    return tmp_path_factory.mktemp("cache")


def validated(workdir: Path, artifact: Path, cache: Path) -> CliResult:
    return run_exporter(
        workdir, *LLAMA, f"artifact={artifact}", "benchmark=off", f"cache_dir={cache}"
    )


def test_a_layer_scaled_after_lowering_is_named_and_not_reproduced_by_lowering(
    lowered_llama: tuple[Path, dict], goldens_cache: Path, tmp_path: Path
) -> None:
    pte, weights = lowered_llama
    down = weights[DOWN_PROJ]
    tampered = rewritten(pte, tmp_path / "tampered.pte", down, down * 2)
    result = validated(tmp_path, tampered, goldens_cache)

    assert result.exit_code == 1, result.output
    report = result.report()
    assert report["passed"] is False
    audit = report["weights_audit"]
    assert [m["parameter"] for m in audit["mismatched"]] == [DOWN_PROJ]
    assert audit["mismatched"][0]["differing"] == down.numel()
    assert audit["checked"] == len(weights) - 1
    found = report["first_divergence"]
    assert found["reproduced"] is False
    assert "not what lowering makes now" in found["reason"]
    assert found["lowerings"] == 1
    assert f"1 constant of the artifact that differs from the model's weights: {DOWN_PROJ}" in (
        result.output
    )
    assert "does not reproduce the failure" in result.output
    (run,) = result.mlflow_runs()
    assert run.data.tags["diverged_at"] == "not reproduced"
    assert run.data.metrics["weights_mismatched"] == 1


def test_an_embedding_row_no_input_reads_fails_the_job_through_the_audit(
    lowered_llama: tuple[Path, dict], goldens_cache: Path, tmp_path: Path
) -> None:
    pte, weights = lowered_llama
    embed = weights[EMBED]
    vocabulary = embed.shape[0]
    drawn = tokens_validation_draws(*LLAMA)
    row = max(set(range(vocabulary)) - drawn)
    corrupted = embed.detach().clone()
    corrupted[row] += 3.0
    corrupted_pte = rewritten(pte, tmp_path / "corrupted.pte", embed, corrupted)
    result = validated(tmp_path, corrupted_pte, goldens_cache)

    assert result.exit_code == 1, result.output
    report = result.report()
    # Every output passes at every shape: only the audit sees the row.
    assert report["passed"] is True
    assert all(shape["passed"] for shape in report["shapes"])
    (mismatch,) = report["weights_audit"]["mismatched"]
    assert mismatch["parameter"] == EMBED
    assert (mismatch["differing_rows"], mismatch["differing"]) == (1, embed.shape[1])
    # Nothing diverges at any shape, so there is nothing to localize.
    assert "first_divergence" not in report
    assert f"differs from the model's weights: {EMBED}" in result.output
    (run,) = result.mlflow_runs()
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "validate")
