"""A cache key sees what determines its result, and only that: the model's code and the libraries
it imports, the lowering code, but not tolerances or the device an artifact will run on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import config
from exporter.cache import fingerprint
from exporter.cache import keys as cache_keys
from exporter.cache.store import key_of
from tests.conftest import PROJECT_ROOT
from tests.test_config import composed


def job(*overrides: str) -> config.JobConfig:
    return config.to_job(composed(*overrides))


def export_key(*overrides: str) -> str:
    chosen = job(*overrides)
    return key_of(cache_keys.export(chosen, cache_keys.model(chosen)))


def lower_key(*overrides: str) -> str:
    chosen = job(*overrides)
    return key_of(cache_keys.lower(chosen, cache_keys.export(chosen, cache_keys.model(chosen))))


def test_a_transformers_upgrade_rebuilds_llama_but_not_the_mlp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = export_key("model=llama"), export_key("model=mlp")
    installed = fingerprint.library_version

    def upgraded(distribution: str) -> str:
        return "99.0" if distribution == "transformers" else installed(distribution)

    monkeypatch.setattr(fingerprint, "library_version", upgraded)
    assert export_key("model=llama") != before[0]
    assert export_key("model=mlp") == before[1]


def test_tolerances_and_the_runtime_device_stay_out_of_the_lowering_key() -> None:
    base = lower_key("model=mlp")
    assert lower_key("model=mlp", "backend.atol=0.5") == base
    assert lower_key("model=mlp", "validate.atol=0.5", "validate.rtol=0.5") == base
    webgpu = lower_key("model=mlp", "backend=webgpu", "backend.device=auto")
    assert lower_key("model=mlp", "backend=webgpu", "backend.device=cpu") == webgpu
    assert webgpu != base
    assert lower_key("model=mlp", "fallback.min_block_size=2") != base


def test_int4_weight_exports_apart_where_a_backend_computes_it_with_the_int4_kernel() -> None:
    # eager and aoti on the CPU plan with the same recipes, but only aoti makes int4_weight's
    # layers the int4 kernel's: one cached export must not stand for the other.
    eager, aoti = (export_key(f"backend={b}", "quantize=int4_weight") for b in ("eager", "aoti"))
    assert eager != aoti
    plain = (export_key(f"backend={b}") for b in ("eager", "aoti"))
    assert len(set(plain)) == 1


def test_the_lowering_key_holds_the_backends_own_code_and_toolchain() -> None:
    chosen = job("model=mlp")
    material = cache_keys.lower(chosen, {})
    assert "exporter/backends/executorch/__init__.py" in material["code"]["sources"]
    assert "exporter/backends/executorch/xnnpack_partitioner.py" in material["code"]["sources"]
    assert "exporter/backends/common/executorch_program.py" in material["code"]["sources"]
    assert "executorch" in material["code"]["libraries"]
    assert "exporter/backends/webgpu/__init__.py" not in material["code"]["sources"]
    # Nor the weights audit's, which the declaration names: an edited reader relowers nothing.
    assert not any(path.startswith("exporter/audit/") for path in material["code"]["sources"])


# A copy of the project, so a test can edit its code as a user would, without touching ours.
@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("project")
    for folder in ("exporter", "runtimes", "conf"):
        shutil.copytree(
            PROJECT_ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


def job_in(project: Path, workdir: Path, *overrides: str) -> tuple[dict, str]:
    """Runs `python -m exporter model=mlp backend=eager OVERRIDES` in the copy, in the next
    run dir of `workdir`; its summary.json and output. Eager's lowering is a cached stage like
    any backend's, done in a second where ExecuTorch's takes a job process 15 s. The summary
    holds the cache's hits and keys, which MLflow's tags copy: without MLflow a job takes
    4 CPU seconds less."""
    run_dir = workdir / f"run-{len(list(workdir.glob('run-*')))}"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "exporter",
            "model=mlp",
            "backend=eager",
            f"hydra.run.dir={run_dir}",
            "mlflow=off",
            f"cache_dir={workdir}/cache",
            # No test here reads a timing: the default benchmark adds seconds to each job.
            "benchmark=off",
            *overrides,
        ],
        cwd=project,
        capture_output=True,
        text=True,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    return json.loads((run_dir / "summary.json").read_text()), output


def hits(summary: dict) -> dict[str, bool]:
    return {kind: summary["cache_hits"][kind] for kind in ("export", "goldens", "lower")}


def test_an_edited_model_or_lowering_rebuilds_a_changed_tolerance_does_not(
    project: Path, tmp_path: Path
) -> None:
    first, _ = job_in(project, tmp_path)
    assert hits(first) == {"export": False, "goldens": False, "lower": False}

    # Both tolerances in one job: were either in a key, that stage would miss.
    loosened, output = job_in(project, tmp_path, "validate.atol=2e-4", "backend.atol=3e-4")
    assert hits(loosened) == {"export": True, "goldens": True, "lower": True}, output
    assert loosened["cache_keys"]["lower"] == first["cache_keys"]["lower"]

    # The scenario: the second ReLU of the MLP becomes a GELU.
    mlp = project / "exporter" / "models" / "mlp.py"
    source = mlp.read_text()
    assert source.count("torch.nn.ReLU(),") == 2
    mlp.write_text(
        source.replace("torch.nn.ReLU(),", "torch.nn.GELU(),").replace(
            "torch.nn.GELU(),", "torch.nn.ReLU(),", 1
        )
    )
    edited, output = job_in(project, tmp_path)
    assert hits(edited) == {"export": False, "goldens": False, "lower": False}, output
    assert "[cache] hit" not in output
    program = (tmp_path / "run-2" / "program.pt2").read_bytes()
    assert b"gelu" in program

    # An edit of the lowering code rebuilds the lowering only: here the device module of
    # backends/common, which eager's lowering imports lazily and the other stages do not.
    lowering = project / "exporter" / "backends" / "common" / "torch_device.py"
    lowering.write_text(lowering.read_text() + "\n# edited\n")
    relowered, output = job_in(project, tmp_path)
    assert hits(relowered) == {"export": True, "goldens": True, "lower": False}, output
