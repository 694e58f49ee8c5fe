"""Shared helpers: run the CLI as a user would, against a store and run dir of the test's own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"


@dataclass
class CliResult:
    exit_code: int
    output: str
    run_dir: Path
    tracking_uri: str

    def report(self) -> dict:
        return json.loads((self.run_dir / "report.json").read_text())

    def mlflow_runs(self) -> list[Run]:
        client = MlflowClient(self.tracking_uri)
        experiment = client.get_experiment_by_name("exporter")
        if experiment is None:
            return []
        return client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])


def run_exporter(workdir: Path, *overrides: str) -> CliResult:
    """`python -m exporter OVERRIDES...` with its run dir and MLflow store inside `workdir`."""
    run_dir = workdir / "run"
    tracking_uri = f"sqlite:///{workdir}/mlflow.db"
    command = [
        sys.executable,
        "-m",
        "exporter",
        f"hydra.run.dir={run_dir}",
        f"mlflow.tracking_uri={tracking_uri}",
        f"mlflow.artifact_location={workdir}/mlartifacts",
        # Last, so a test can override the defaults above.
        *overrides,
    ]
    completed = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    return CliResult(
        completed.returncode, completed.stdout + completed.stderr, run_dir, tracking_uri
    )


@pytest.fixture
def exporter_cli(tmp_path: Path) -> Callable[..., CliResult]:
    """Each call runs the CLI in a fresh folder under tmp_path."""
    numbers = count()

    def run(*overrides: str) -> CliResult:
        workdir = tmp_path / f"job{next(numbers)}"
        workdir.mkdir()
        return run_exporter(workdir, *overrides)

    return run
