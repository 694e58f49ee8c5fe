"""A job stopped by Ctrl-C, or whose process dies, still ends with a record: exit code, MLflow
run status and the stage it was in, and no partial folder left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.cache.store import Cache
from tests.conftest import mlflow_runs, run_stopped, tracking_uri_in


def stopped_in_lowering(
    workdir: Path, stop: Callable[[subprocess.Popen], object], *overrides: str
) -> tuple[int, str]:
    """Runs an mlp job, calls `stop(process)` once lowering has started; returns the command's
    exit code and its output."""
    return run_stopped(
        [
            "model=mlp",
            f"hydra.run.dir={workdir}/run",
            f"mlflow.tracking_uri={tracking_uri_in(workdir)}",
            f"mlflow.artifact_location={workdir}/mlartifacts",
            f"cache_dir={workdir}/cache",
            *overrides,
        ],
        "[lower] started",
        stop,
    )


def last_job_lines(output: str) -> list[str]:
    """The `[job] ...` lines the output ends with."""
    lines = output.rstrip().splitlines()
    count = next(n for n, line in enumerate(reversed(lines)) if "] [job] " not in line)
    return lines[len(lines) - count :]


def leftovers(workdir: Path) -> list[Path]:
    """Partial files in the run dir and staging folders in the cache."""
    return [*(workdir / "run").glob(".partial-*"), *(workdir / "cache").glob("*/.staging-*")]


def worker_of(process: subprocess.Popen) -> int:
    """The job's worker: the child of the command's process that runs exporter's job."""
    children = subprocess.run(
        ["pgrep", "-P", str(process.pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    (worker,) = [int(pid) for pid in children if "exporter.job.worker" in _cmdline(int(pid))]
    return worker


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.parametrize("cache", ["off", "on"])
def test_ctrl_c_while_lowering_ends_the_run_killed_at_lower_with_no_partial_folder(
    tmp_path: Path, cache: str
) -> None:
    exit_code, output = stopped_in_lowering(
        tmp_path, lambda process: process.send_signal(signal.SIGINT), f"cache={cache}"
    )
    assert exit_code == 130, output
    assert "terminate called" not in output and "Traceback" not in output
    assert "[lower] stopped by Ctrl-C" in output
    assert (
        "[job] KILLED (exit 130) during the lower stage: stopped by Ctrl-C (SIGINT)"
        in last_job_lines(output)[0]
    )
    (run,) = mlflow_runs(tracking_uri_in(tmp_path))
    assert run.info.status == "KILLED"
    assert (run.data.tags["status"], run.data.tags["failed_stage"]) == ("killed", "lower")
    assert run.data.tags["exit_code"] == "130"
    # What stopped it, in the summary, the run's error and its description.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"] == run.data.tags["error"] == "stopped by Ctrl-C (SIGINT)"
    assert run.data.tags["mlflow.note.content"] == (
        "killed (exit 130) during the lower stage: stopped by Ctrl-C (SIGINT)"
    )
    assert leftovers(tmp_path) == []


def test_a_worker_killed_while_lowering_fails_the_run_at_lower(tmp_path: Path) -> None:
    # What the kernel's out-of-memory killer does to a job that outgrows the machine.
    exit_code, output = stopped_in_lowering(
        tmp_path, lambda process: os.kill(worker_of(process), signal.SIGKILL)
    )
    assert exit_code == 4, output
    assert "the job's process was killed (SIGKILL" in output
    outcome = "[job] FAILED (exit 4) at the lower stage: the job's process was killed (SIGKILL"
    assert outcome in last_job_lines(output)[0]
    (run,) = mlflow_runs(tracking_uri_in(tmp_path))
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "lower")
    assert "SIGKILL" in run.data.tags["error"]
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"failed_stage": "lower"' in summary
    assert leftovers(tmp_path) == []


def test_a_worker_that_segfaults_shows_its_last_words_and_keeps_them_in_native_log(
    tmp_path: Path,
) -> None:
    # No MLflow run is judged here: the job's process starts without importing MLflow.
    exit_code, output = stopped_in_lowering(
        tmp_path, lambda process: os.kill(worker_of(process), signal.SIGSEGV), "mlflow=off"
    )
    assert exit_code == 4, output
    assert "the job's process crashed (SIGSEGV) during the lower stage" in output
    # Python's fault handler's words, and the stack it was in, on the terminal and in the file.
    native = (tmp_path / "run" / "native.log").read_text()
    assert "Fatal Python error: Segmentation fault" in native
    assert "[lower] the end of native.log:\nFatal Python error: Segmentation fault" in output
    assert "File " in output.split("the end of native.log:", 1)[1]
    assert (
        "[job] FAILED (exit 4) at the lower stage: the job's process crashed"
        in last_job_lines(output)[0]
    )


def test_the_next_build_removes_what_a_dead_process_left_in_the_cache(tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(finished.stdout)
    cache = Cache(tmp_path)
    (tmp_path / "export").mkdir()
    orphan = tmp_path / "export" / f".staging-abc-pid{dead}@{socket.gethostname()}-x1"
    alive = tmp_path / "export" / f".staging-abc-pid{os.getpid()}@{socket.gethostname()}-x2"
    elsewhere = tmp_path / "export" / f".staging-abc-pid{dead}@another-host-x3"
    for folder in (orphan, alive, elsewhere):
        folder.mkdir()
    cache.fetch("export", {"a": 1}, lambda out: (out / "f").write_bytes(b"1"))
    assert not orphan.exists()
    assert alive.exists() and elsewhere.exists()
