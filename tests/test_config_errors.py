"""Every kind of configuration error ends the command alike, whether Hydra finds it composing
or the job's schema checking the values: exit 2, a message on stderr naming the key, nothing
on stdout, no traceback or warning, and no run dir for the job that never started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT, run_command


@pytest.mark.parametrize(
    ("override", "named"),
    [
        # Hydra: a key the schema lacks, given without `+`.
        ("validate.atoll=1", "Could not override 'validate.atoll'"),
        # The job's check of keys added with `+`, which Hydra lets through.
        ("+validat.atol=1", "unknown key +validat.atol (nearest valid key: validate.atol)"),
        # Hydra: an option its group lacks.
        ("model=nope", "Could not find 'model/nope'"),
        # Hydra: a value the schema's type rejects.
        ("validate.rule=nope", "full_key: validate.rule"),
        # The schema's checks of values.
        ("validate.atol=-1", "validate.atol is -1.0; it must be 0 or more"),
        ("dynamic.seq.max=0", "dynamic.seq: min (1) is greater than max (0)"),
        # An override that does not parse.
        ("validate.atol=[", "cannot parse the override validate.atol=[: "),
    ],
)
def test_a_configuration_error_exits_2_on_stderr_leaving_no_run_dir(
    tmp_path: Path, override: str, named: str
) -> None:
    runs = tmp_path / "runs"
    completed = run_command(tmp_path, f"hydra.run.dir={runs}/run", override)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert named in completed.stderr
    assert completed.stdout == ""
    assert "Traceback" not in completed.stderr
    assert "Warning" not in completed.stderr
    assert not runs.exists()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        # Hydra checks these before composing, past its own reporting.
        (["--cfg", "job", "-m"], "Only one of --run, --multirun, --cfg"),
        (["--help", "model=nope"], "Could not find 'model/nope'"),
    ],
)
def test_flags_hydra_refuses_exit_2_without_a_traceback(arguments: list[str], named: str) -> None:
    command = [sys.executable, "-m", "exporter", *arguments]
    completed = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert named in completed.stderr
    assert "Traceback" not in completed.stderr
