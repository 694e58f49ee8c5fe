"""Parallel jobs share one SQLite store: a process writing to it holds its lock file, and any
other process waits for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from exporter.tracking import runs as tracking

TRY_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
"""


def another_process_can_lock(lock_path: Path) -> bool:
    completed = subprocess.run([sys.executable, "-c", TRY_LOCK, str(lock_path)], check=False)
    return completed.returncode == 0


def test_a_sqlite_store_is_written_by_one_process_at_a_time(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    lock_path = tmp_path / "store" / "mlflow.db.lock"
    with tracking._serialized(uri):
        assert lock_path.exists()
        assert not another_process_can_lock(lock_path)
    assert another_process_can_lock(lock_path)
