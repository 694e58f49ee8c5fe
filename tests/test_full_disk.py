"""A full disk wherever a job writes ends it with one line naming what was being written, where,
and the room left there; exit 2 (exporter/errors.py's DiskFull), no traceback, the job recorded
as failed where its record can still be written, and nothing half written left behind.

On a filesystem that really fills: a 1 MB tmpfs, mounted for each test. Tests run as root on
Linux (CI too), where mounting one cannot fail without the test failing, unless the container
denies root the capability to mount; elsewhere they skip."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.cache.store import MANIFEST
from exporter.tracking.comparison.summary import SUMMARY_FILE
from runtimes.files import PARTIAL_PREFIX
from tests.conftest import mlflow_runs, run_command, tracking_uri_in

SIZE = "1m"
# What the one line says of the room left: `36.9 kB free of 1.0 MB there`.
ROOM_LEFT = r"[\d.]+ (bytes|kB|MB) free of 1\.0 MB there"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs of the test's own, unmounted after it."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
        problem = mounted.stderr.strip() if mounted.returncode else None
    except FileNotFoundError as error:
        problem = str(error)
    if problem is not None:
        reason = f"cannot mount a {SIZE} tmpfs at {mount_point}: {problem}"
        if os.geteuid() != 0:
            pytest.skip(f"{reason} (mounting needs root)")
        if "permission denied" in problem.lower():
            # A container without the capability to mount: no filesystem here can be filled.
            pytest.skip(f"{reason} (root without the capability to mount)")
        pytest.fail(reason)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[ERROR]" in line]


def assert_no_partial_files(folder: Path) -> None:
    """No staging folder of the cache or partial file of an atomic write under `folder`, and
    every cache entry whole: its files those its manifest lists, at their sizes."""
    assert [p for p in folder.rglob("*") if p.name.startswith((".staging-", PARTIAL_PREFIX))] == []
    for manifest in folder.rglob(MANIFEST):
        listed = json.loads(manifest.read_text())["files"]
        entry = manifest.parent
        present = {p.name: p.stat().st_size for p in entry.iterdir() if p.name != MANIFEST}
        assert present == {name: file["bytes"] for name, file in listed.items()}, entry


def test_a_cache_entry_that_fills_the_disk_fails_the_job_in_one_line(
    tmp_path: Path, small_disk: Path
) -> None:
    """Issue 41: the cache and the run dir on a 1 MB disk; the exported program (0.98 MB) fits,
    the goldens do not."""
    cache_dir, run_dir = small_disk / "cache", small_disk / "run"
    completed = run_command(
        tmp_path, f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}", "benchmark=off"
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert "Traceback" not in output
    (line,) = error_lines(output)
    entry = re.escape(str(cache_dir / "goldens")) + r"/\w+"
    assert re.search(
        rf"\[goldens\] No space left on device writing the goldens' cache entry {entry}: "
        rf"{ROOM_LEFT}; ",
        line,
    ), line
    assert "[job] FAILED (exit 2) at the goldens stage: No space left on device" in output
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    assert (summary["status"], summary["exit_code"], summary["failed_stage"]) == (
        "failed",
        2,
        "goldens",
    )
    assert line.endswith(summary["error"])
    (run,) = mlflow_runs(tracking_uri_in(tmp_path))
    assert (run.info.status, run.data.tags["status"]) == ("FAILED", "failed")
    # The exported program's entry is whole; the goldens' left nothing.
    assert list((cache_dir / "goldens").iterdir()) == []
    assert (cache_dir / "export").is_dir()
    assert_no_partial_files(small_disk)


def test_a_disk_full_before_the_job_refuses_it_in_one_line(
    tmp_path: Path, small_disk: Path
) -> None:
    # Unbuffered: the write that finds no room raises, and closing has nothing left to write.
    with (
        (small_disk / "filler").open("wb", buffering=0) as filler,
        pytest.raises(OSError, match="No space left"),
    ):
        while True:
            filler.write(bytes(1 << 16))
    cache_dir, run_dir = small_disk / "cache", small_disk / "run"
    completed = run_command(
        tmp_path, f"cache_dir={cache_dir}", f"hydra.run.dir={run_dir}", "benchmark=off"
    )
    assert completed.returncode == 2, completed.stderr
    assert "Traceback" not in completed.stdout + completed.stderr
    assert completed.stdout == ""
    assert re.fullmatch(
        rf"\[config\] No space left on device writing the cache \(cache_dir\) "
        rf"{re.escape(str(cache_dir))}: 0 bytes free of 1\.0 MB there; .*\n",
        completed.stderr,
    ), completed.stderr
    # Refused before its run dir was claimed, as a job its configuration stops.
    assert not run_dir.exists()


def test_an_mlflow_store_that_fills_fails_the_run_that_passed(
    tmp_path: Path, small_disk: Path
) -> None:
    """The run's files go to an artifact folder on the 1 MB disk: its program (0.98 MB) and the
    rest of the run dir do not fit. The database is elsewhere, so the run is closed FAILED."""
    artifacts, run_dir = small_disk / "mlartifacts", tmp_path / "run"
    completed = run_command(
        tmp_path,
        f"hydra.run.dir={run_dir}",
        f"mlflow.artifact_location={artifacts}",
        "backend=eager",
        "benchmark=off",
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output
    assert "Traceback" not in output
    (line,) = error_lines(output)
    (run,) = mlflow_runs(tracking_uri_in(tmp_path))
    folder = re.escape(str(artifacts / run.info.run_id / "artifacts"))
    assert re.search(
        rf"\[track\] No space left on device writing the MLflow run's files {folder}: "
        rf"{ROOM_LEFT}; ",
        line,
    ), line
    assert "[job] PASSED (exit 2) at all 7 live shapes; its MLflow run was not written" in output
    assert run.info.status == "FAILED"
    # What the run got of the run dir's files, it got whole (the job's log grows after).
    logged = [path for path in artifacts.rglob("*") if path.is_file() and path.suffix != ".log"]
    assert logged
    for path in logged:
        kept = run_dir / path.relative_to(artifacts / run.info.run_id / "artifacts")
        assert path.stat().st_size == kept.stat().st_size, path
