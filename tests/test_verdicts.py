"""The reference rule: a correct bfloat16 artifact passes where the absolute default fails it, and
an artifact whose weights of one layer were scaled by 1.01 after lowering fails, in float32
(judged by the real command, which says what factor would pass) and in bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from exporter import config, models
from tests.conftest import CONF_DIR, CliResult, job_in_process

# The failures here are about the verdict; where they come from is test_localize's to show, and
# a search after each one would cost more than the rest of the test.
NO_SEARCH = ("validate.localize=off",)
# One decoder layer is enough for a layer to be wrong in, and lowers in two thirds of the time.
LLAMA = ("model=llama", "model.num_hidden_layers=1")


def built_in_process(tmp_path: Path, *overrides: str) -> tuple[Path, dict, str]:
    """The artifact of a passing job, made in the test's process: its file, its report, and the
    override that has the commands judging it find its exported program and goldens."""
    cache_dir = tmp_path / "cache"
    record, report = job_in_process(tmp_path / "built", *overrides, cache_dir=cache_dir)
    assert record.exit_code == 0, record.error
    return tmp_path / "built" / "model.pte", report, f"cache_dir={cache_dir}"


def weight_of(parameter: str, *overrides: str) -> torch.Tensor:
    """The seeded weight the job's model stage builds."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        job = config.to_job(compose("config", overrides=list(overrides)))
    bundle = models.build(job.model, job.dynamic)
    return bundle.module.get_parameter(parameter).detach()


def scaled_copy(artifact: Path, weight: torch.Tensor, factor: float, out: Path) -> Path:
    """The artifact with `weight`'s bytes, found once in the file, replaced by weight * factor in
    the same dtype: what a corrupted or stale artifact looks like to its runtime."""
    data = artifact.read_bytes()
    original = weight.contiguous().view(torch.uint8).numpy().tobytes()
    assert data.count(original) == 1, "the weight is not stored as-is in the artifact"
    scaled = (weight * factor).to(weight.dtype).contiguous().view(torch.uint8).numpy().tobytes()
    assert scaled != original
    out.write_bytes(data.replace(original, scaled))
    return out


def test_a_float32_llama_with_one_layer_scaled_by_1_01_fails_the_reference_rule(
    exporter_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    artifact, _, cache = built_in_process(tmp_path, *LLAMA, "backend=executorch")
    layer = "model.model.layers.0.mlp.down_proj.weight"
    tampered = scaled_copy(artifact, weight_of(layer, *LLAMA), 1.01, tmp_path / "t.pte")
    judged = exporter_cli(
        *LLAMA, "backend=executorch", f"artifact={tampered}", "mlflow=off", cache, *NO_SEARCH
    )
    assert judged.exit_code == 1, judged.output
    report = judged.report()
    assert not report["passed"] and report["rule"] == "reference"
    # Eager float32's error is ~1e-7; a 1% error in one layer is thousands of times that.
    assert all(float(shape["ratio"]) > 100 for shape in report["shapes"])
    assert "The smallest validate.factor that would pass them all is" in judged.output


def test_bfloat16_a_correct_artifact_passes_where_atol_fails_and_a_scaled_head_fails(
    tmp_path: Path,
) -> None:
    # In this process, all three jobs: the verdicts are the point, and the command that states
    # one is the float32 test's.
    bf16 = (*LLAMA, "model.dtype=bfloat16", "backend=executorch")
    artifact, report, _ = built_in_process(tmp_path, *bf16)
    shapes = report["shapes"]
    # The artifact is as precise as eager bfloat16 (its error over eager's near 1), which is
    # far beyond the absolute default's atol.
    assert all(float(shape["ratio"]) < 1.5 for shape in shapes)
    assert min(float(shape["max_abs"]) for shape in shapes) > report["atol"]

    def judged(name: str, *overrides: str) -> tuple[int, dict]:
        record, report = job_in_process(
            tmp_path / name, *bf16, *overrides, *NO_SEARCH, cache_dir=tmp_path / "cache"
        )
        return record.exit_code, report

    absolute, _ = judged("absolute", f"artifact={artifact}", "validate.rule=absolute")
    assert absolute == 1

    head = weight_of("model.lm_head.weight", *LLAMA, "model.dtype=bfloat16")
    tampered = scaled_copy(artifact, head, 1.01, tmp_path / "t.pte")
    exit_code, report = judged("tampered", f"artifact={tampered}")
    assert exit_code == 1
    # A 1% error in bfloat16 is about two of its roundings: twice eager's error, not more.
    assert max(float(shape["ratio"]) for shape in report["shapes"]) > 1.5
