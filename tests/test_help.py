"""`python -m exporter --help` as a newcomer reads it: about one screen, with usage examples that
compose, the default job, where results go as real paths, every exit code, and the groups a
user chooses from (not the schemas stored beside them)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import CONF_DIR, PROJECT_ROOT

# Every exit code the command ends with (DESIGN.md, exporter/errors.py, a stop's signal).
EXIT_CODES = {0, 1, 2, 3, 4, 5, 6, 7, 130, 143}


@pytest.fixture(scope="module")
def help_text() -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "exporter", "--help"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_help_fits_about_one_screen(help_text: str) -> None:
    lines = help_text.splitlines()
    assert len(lines) <= 60
    assert max(map(len, lines)) <= 100


def test_help_shows_usage_examples_that_compose(help_text: str) -> None:
    examples = re.findall(r"^  python -m exporter(.*?)(?:  |$)", help_text, re.MULTILINE)
    arguments = [shlex.split(example) for example in examples]
    assert ["-m", "backend=eager,executorch"] in arguments
    assert ["--cfg", "job", "model=mlp"] in arguments
    assert [] in arguments
    assert "python -m runtimes.check BUNDLE" in help_text
    overrides = [a for a in arguments if a and a[0] not in ("-m", "--cfg", "track")]
    assert overrides, examples
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for override in overrides:
            compose("config", overrides=override)


def test_help_says_what_the_default_job_is_and_where_results_go(help_text: str) -> None:
    assert "Default job: a small Llama" in help_text
    assert "ExecuTorch with XNNPACK on CPU" in help_text
    assert f"{PROJECT_ROOT}/outputs/runs/DATE/TIME-MODEL-BACKEND/" in help_text
    assert f"sqlite:///{PROJECT_ROOT}/outputs/mlflow.db" in help_text
    assert f"{PROJECT_ROOT}/outputs/cache/" in help_text
    assert "${" not in help_text


def test_help_lists_every_exit_code(help_text: str) -> None:
    listed = help_text.partition("Exit codes: ")[2].partition("\n\n")[0]
    assert set(map(int, re.findall(r"\b(\d+) [A-Za-z]", listed))) == EXIT_CODES


def test_help_lists_every_option_of_conf_and_no_schema(help_text: str) -> None:
    assert "schema" not in help_text
    groups = dict(re.findall(r"^  ([\w/]+) +(.*(?:\n {4,}.*)*)", help_text, re.MULTILINE))
    # An experiment is added with `+experiment=NAME`, not chosen in place of a default.
    experiments = "optional (+experiment=NAME): "
    assert groups["experiment"].startswith(experiments)
    groups["experiment"] = groups["experiment"].removeprefix(experiments)
    for folder in sorted(CONF_DIR.iterdir()):
        if folder.is_dir() and folder.name != "dynamic":
            options = {name.rstrip("*") for name in re.split(r",\s+", groups[folder.name])}
            assert options == {path.stem for path in folder.glob("*.yaml")}, folder.name
    assert groups["dynamic"].startswith("follows model")
    # The default job's choices are the ones marked; it has no experiment.
    assert "*" not in groups["experiment"]
    assert "executorch*" in groups["backend"]
    assert "llama*" in groups["model"]
    assert "joblib" in groups["hydra/launcher"]
