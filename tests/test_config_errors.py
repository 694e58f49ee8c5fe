"""Every kind of configuration error ends the command alike, whether Hydra finds it composing,
the job's schema checking the values, or the command checking the places the job writes: exit 2,
a message on stderr naming the key, nothing on stdout, no traceback or warning, no run dir for
the job that never started, and torch never imported: the command refuses a bad config before
it loads torch (exporter/command/cli.py), so each kind of refusal takes a second, not the
job's imports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT, command_line

# `python -m exporter ARGUMENTS...`, which, as the process exits, writes into the file that
# $TORCH_LOADED names whether it imported torch.
WATCHING_TORCH = """
import atexit, os, runpy, sys
atexit.register(lambda: open(os.environ["TORCH_LOADED"], "w").write(str("torch" in sys.modules)))
runpy.run_module("exporter", run_name="__main__", alter_sys=True)
"""
# A file in the test's folder where the config names a folder to write in.
A_FILE = "a_file"


def refused(workdir: Path, arguments: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The command's run on `arguments`, which it must refuse without importing torch."""
    torch_loaded = workdir / "torch_loaded"
    completed = subprocess.run(
        [sys.executable, "-c", WATCHING_TORCH, *arguments],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_LOADED": str(torch_loaded)},
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert "Traceback" not in completed.stderr
    assert torch_loaded.is_file(), f"the command ended before its exit handlers ran: {output}"
    assert torch_loaded.read_text() == "False", f"torch was imported before the refusal: {output}"
    return completed


def closed_port() -> int:
    """A local port nobody listens on (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # Hydra: a key the schema lacks, given without `+`.
        pytest.param(
            ["validate.atoll=1"], "Could not override 'validate.atoll'", id="hydra-unknown-key"
        ),
        # The job's check of keys added with `+`, which Hydra lets through.
        pytest.param(
            ["+validat.atol=1"],
            "unknown key +validat.atol (nearest valid key: validate.atol)",
            id="added-unknown-key",
        ),
        # Hydra: an option its group lacks.
        pytest.param(["model=nope"], "Could not find 'model/nope'", id="hydra-unknown-option"),
        # Hydra: a value the schema's type rejects.
        pytest.param(["validate.rule=nope"], "full_key: validate.rule", id="hydra-wrong-type"),
        # The schema's checks of values.
        pytest.param(
            ["validate.atol=-1"], "validate.atol is -1.0; it must be 0 or more", id="schema-value"
        ),
        pytest.param(
            ["dynamic.seq.max=0"],
            "dynamic.seq: min (1) is greater than max (0)",
            id="schema-values-together",
        ),
        # An override that does not parse.
        pytest.param(
            ["validate.atol=["], "cannot parse the override validate.atol=[: ", id="unparsable"
        ),
        # A backend's refusal of what it does not compute right, or where it does not run.
        pytest.param(
            ["backend=executorch", "quantize=int4_weight"],
            "quantize=int4_weight: backend=executorch runs quantize=none, 8da4w, 8da8w, auto",
            id="backend-refuses-quantize",
        ),
        pytest.param(
            ["backend=executorch", "backend.device=cuda"],
            "backend=executorch runs on cpu",
            id="backend-refuses-device",
        ),
        # A value the job needs and no default gives.
        pytest.param(
            ["mlflow.tracking_uri="], "mlflow.tracking_uri is not set", id="value-not-set"
        ),
        # A checkpoint that is not there.
        pytest.param(
            ["model=hf", "model.checkpoint=/no/such/dir"],
            "model.checkpoint=/no/such/dir: no such directory or file",
            id="no-checkpoint",
        ),
        # The places the job writes: the cache, the MLflow store and its artifacts, the run dir.
        pytest.param(
            [f"cache_dir={{tmp}}/{A_FILE}"], "the cache (cache_dir)", id="cache-not-writable"
        ),
        pytest.param(
            [f"mlflow.tracking_uri=sqlite:///{{tmp}}/{A_FILE}/mlflow.db"],
            "the MLflow store's folder (mlflow.tracking_uri)",
            id="store-not-writable",
        ),
        pytest.param(
            [f"mlflow.artifact_location={{tmp}}/{A_FILE}"],
            "MLflow's artifact folder (mlflow.artifact_location)",
            id="artifacts-not-writable",
        ),
        pytest.param(
            [f"hydra.run.dir={{tmp}}/{A_FILE}/run"],
            "cannot create the run dir (hydra.run.dir)",
            id="run-dir-not-writable",
        ),
        # A tracking server that does not answer.
        pytest.param(
            ["mlflow.tracking_uri=http://127.0.0.1:{port}"],
            "no MLflow tracking server answers at mlflow.tracking_uri=http://127.0.0.1:",
            id="server-not-answering",
        ),
    ],
)
def test_a_configuration_error_exits_2_on_stderr_leaving_no_run_dir_nor_torch_loaded(
    tmp_path: Path, overrides: list[str], named: str
) -> None:
    (tmp_path / A_FILE).write_text("not a folder")
    runs = tmp_path / "runs"
    given = [o.format(tmp=tmp_path, port=closed_port()) for o in overrides]
    arguments = command_line(tmp_path, f"hydra.run.dir={runs}/run", *given)[3:]
    completed = refused(tmp_path, arguments)
    assert named in completed.stderr
    assert completed.stdout == ""
    assert "Warning" not in completed.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    ("override", "named"),
    [
        pytest.param(
            f"hydra.sweep.dir={{tmp}}/{A_FILE}/sweep",
            "cannot create the sweep dir (hydra.sweep.dir)",
            id="sweep-dir-not-writable",
        ),
        pytest.param(
            f"mlflow.tracking_uri=sqlite:///{{tmp}}/{A_FILE}/mlflow.db",
            "the MLflow store's folder (mlflow.tracking_uri)",
            id="store-not-writable",
        ),
    ],
)
def test_a_sweep_whose_shared_places_cannot_be_written_starts_no_job_nor_torch(
    tmp_path: Path, override: str, named: str
) -> None:
    (tmp_path / A_FILE).write_text("not a folder")
    sweeps = tmp_path / "sweeps"
    arguments = command_line(
        tmp_path,
        f"hydra.sweep.dir={sweeps}/sweep",
        "backend=eager,executorch",
        override.format(tmp=tmp_path),
        multirun=True,
    )[3:]
    completed = refused(tmp_path, arguments)
    assert named in completed.stderr
    assert completed.stdout == ""
    assert not sweeps.exists()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        # Hydra checks these before composing, past its own reporting.
        pytest.param(
            ["--cfg", "job", "-m"], "Only one of --run, --multirun, --cfg", id="flags-conflict"
        ),
        pytest.param(["--help", "model=nope"], "Could not find 'model/nope'", id="help-of-bad"),
    ],
)
def test_flags_hydra_refuses_exit_2_without_a_traceback_nor_torch(
    tmp_path: Path, arguments: list[str], named: str
) -> None:
    completed = refused(tmp_path, arguments)
    assert named in completed.stderr
