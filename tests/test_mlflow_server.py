"""Jobs and sweeps against a real `mlflow server` on 127.0.0.1 (SQLite backend, local artifact
root), the setup the README gives for several machines: every run, its nesting and its files
read back through the server; and a server that goes away mid-job is a tracking failure (exit
7), not a lost result."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import mlflow_runs, run_stopped, run_sweep


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{folder}/mlflow.db",
            "--artifacts-destination",
            str(folder / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2).close()
            return server, uri
        except OSError:
            assert server.poll() is None, (folder / "server.log").read_text()
            time.sleep(0.5)
    server.kill()
    raise AssertionError(f"mlflow server did not answer: {(folder / 'server.log').read_text()}")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    folder = tmp_path / "server"
    folder.mkdir()
    started = start_server(folder)
    yield started
    stop(started[0])


def to_the_server(uri: str) -> list[str]:
    # The server keeps the artifacts: the experiment names no local folder of this machine.
    return ["mlflow=server", f"mlflow.tracking_uri={uri}", "mlflow.artifact_location="]


@pytest.mark.slow
def test_a_parallel_sweep_against_a_server_reads_back_through_it(
    tmp_path: Path, server: tuple[subprocess.Popen, str]
) -> None:
    _, uri = server
    sweep = run_sweep(
        tmp_path,
        tmp_path / "sweep",
        "model=mlp",
        "backend=eager,executorch",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *to_the_server(uri),
    )
    assert sweep.exit_code == 0, sweep.output
    runs = mlflow_runs(uri)
    (parent,) = [r for r in runs if r.data.tags.get("sweep.dir") == str(sweep.sweep_dir)]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["jobs_passed"] == 2
    assert sorted(r.data.tags["backend"] for r in children) == ["eager", "executorch"]
    assert all(r.info.status == "FINISHED" for r in children)
    client = MlflowClient(uri)
    assert "comparison.csv" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    for child in children:
        files = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"program.pt2", "report.json", "summary.json"} <= files
        fetched = mlflow.artifacts.download_artifacts(
            run_id=child.info.run_id,
            artifact_path="report.json",
            dst_path=str(tmp_path / child.info.run_id),
            tracking_uri=uri,
        )
        job_dir = sweep.sweep_dir / child.data.tags["job"]
        local = json.loads((job_dir / "report.json").read_text())
        assert json.loads(Path(fetched).read_text()) == local
    executorch = next(r for r in children if r.data.tags["backend"] == "executorch")
    assert "model.pte" in {a.path for a in client.list_artifacts(executorch.info.run_id)}


@pytest.mark.slow
def test_a_server_gone_mid_job_is_a_tracking_failure_and_the_run_dir_keeps_the_result(
    tmp_path: Path, server: tuple[subprocess.Popen, str]
) -> None:
    process, uri = server
    exit_code, output = run_stopped(
        [
            "model=mlp",
            "backend=eager",
            f"hydra.run.dir={tmp_path}/run",
            f"cache_dir={tmp_path}/cache",
            *to_the_server(uri),
        ],
        "(RUNNING)",
        lambda _: stop(process),
    )
    assert exit_code == 7, output
    assert "[track] MLflow run" in output and "could not be written" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("passed", 0)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["passed"]
