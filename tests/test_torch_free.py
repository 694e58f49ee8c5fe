"""The command's own process never imports torch: it composes configs, starts each job's worker
and watches it, writes a sweep's comparison and MLflow runs, and attaches a target's check
(`python -m exporter track`); only the worker loads torch, for the stages. torch takes seconds
and about 1 GB to import, once per sweep and again per job concluded after its worker died."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT

# What the command's process imports: the command at its start (the sweep's callback, the
# worker's frame, `track`), and where tracking is on, once needed: MLflow's runs (a sweep's
# parent run, a job concluded after its worker died, `track`) and the report `track` reads.
COMMAND_IMPORTS = ("exporter.command.cli", "exporter.tracking.runs", "runtimes.verdict.report")


@pytest.mark.parametrize("module", COMMAND_IMPORTS)
def test_the_commands_process_imports_no_torch(module: str) -> None:
    # A fresh process: the test's own has torch loaded already.
    code = (
        f"import sys, {module}; "
        "loaded = sorted(name for name in sys.modules if name.split('.')[0] == 'torch'); "
        "assert not loaded, loaded[:5]"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr
