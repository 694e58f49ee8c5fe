"""Shared helpers: run the CLI as a user would, against a store and run dir of the test's own."""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import count
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig

from exporter import backends, config
from exporter.command import schemas
from exporter.errors import ValidationFailed
from exporter.job import stages
from exporter.tracking.record import JobRecord

# Tests compose configs with Hydra's compose API, as the command does after storing the schemas.
schemas.register_schemas()

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"


# xdist's loadfile hands a worker the next file whenever its queue runs low, in the order they
# were collected (pyproject turns off xdist's own order, by number of tests, which put the files
# of a few long jobs last: one worker ran test_verdicts.py alone for the suite's last minutes).
# The files whose jobs take minutes go first, about longest first by a run's `--durations`, so
# the last ones handed out are short: the default suite's (25 s to 4 min each) and, for
# `-m slow`, the slow tests' (1 to 8 min each).
LONGEST_FILES = (
    "test_fallback.py",
    "test_cli.py",
    "test_half_verdict.py",
    "test_bundle.py",
    "test_webgpu.py",
    "test_cache_keys.py",
    "test_tampered_artifacts.py",
    "test_target_run.py",
    "test_wrong_kernels.py",
    "test_verdicts.py",
    "test_localize.py",
    "test_hf_models.py",
    "test_sweep.py",
    "test_interrupts.py",
    "test_kv_report.py",
    "test_external_weights.py",
    "test_audit.py",
    "test_kv_artifacts.py",
    "test_kv_backends.py",
    "test_hf_encoder.py",
    "test_webgpu_images.py",
    "test_run.py",
    "test_encoder.py",
    "test_outputs.py",
    "test_aoti.py",
    "test_export_failures.py",
)
LONGEST_SLOW_FILES = (
    "test_quantize.py",
    "test_hf_models.py",
    "test_webgpu.py",
    "test_slurm.py",
    "test_sweep.py",
    "test_mlflow_server.py",
    "test_aoti.py",
    "test_kv_artifacts.py",
    "test_kv_backends.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    longest = LONGEST_SLOW_FILES if config.getoption("markexpr") == "slow" else LONGEST_FILES
    place = {name: rank for rank, name in enumerate(longest)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


def composed(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)


def job_in_process(
    run_dir: Path, *overrides: str, cache_dir: Path | None = None
) -> tuple[JobRecord, dict]:
    """Runs one job's stages in this process; its record and report.json. For tests of what the
    stages compute, not of the command: it skips the command's ~5 s of imports in a fresh
    process. The search has no time limit unless the overrides set one: what it finds must not
    depend on the machine's load. With `cache_dir`, the job stores what it makes there, for the
    commands of a test to find."""
    unbounded = (
        ()
        if any(o.startswith("validate.localize_seconds=") for o in overrides)
        else ("validate.localize_seconds=null",)
    )
    cache = ("cache=false",) if cache_dir is None else ("cache=true", f"cache_dir={cache_dir}")
    job = config.to_job(composed(*overrides, *unbounded, "mlflow=off", "benchmark=off", *cache))
    record = JobRecord(run_dir=run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        stages.run(job, backends.configured(job), record, lambda *_: None)
    except ValidationFailed as error:
        record.error = error
    return record, json.loads((run_dir / stages.REPORT_FILE).read_text())


@dataclass
class CliResult:
    exit_code: int
    output: str
    run_dir: Path
    tracking_uri: str

    def report(self) -> dict:
        return json.loads((self.run_dir / "report.json").read_text())

    def mlflow_runs(self) -> list[Run]:
        return mlflow_runs(self.tracking_uri)


def mlflow_runs(tracking_uri: str) -> list[Run]:
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("exporter")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], order_by=["start_time ASC"])


def tracking_uri_in(workdir: Path) -> str:
    return f"sqlite:///{workdir}/mlflow.db"


BRIEF_BENCHMARK = ("benchmark.warmup=0", "benchmark.seconds=0.01")


@cache
def empty_store() -> Path:
    """A SQLite MLflow store whose tables are made and which holds no run: making them costs a
    job on a fresh store seconds of its startup (12 of 16 on a loaded 2-core machine)."""
    folder = Path(tempfile.mkdtemp(prefix="exporter-tests-store-"))
    atexit.register(shutil.rmtree, folder, True)
    MlflowClient(tracking_uri_in(folder)).search_experiments()
    return folder / "mlflow.db"


def run_command(
    workdir: Path, *overrides: str, multirun: bool = False
) -> subprocess.CompletedProcess[str]:
    """`python -m exporter [-m] OVERRIDES...` with its MLflow store and cache inside `workdir`.
    A job that tracks to `workdir`'s store finds the store made (empty_store), as every job but
    a store's first does."""
    store = workdir / "mlflow.db"
    if not store.exists() and not any(o.startswith(("mlflow=", "mlflow.")) for o in overrides):
        shutil.copyfile(empty_store(), store)
    command = command_line(workdir, *overrides, multirun=multirun)
    return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)


def command_line(workdir: Path, *overrides: str, multirun: bool = False) -> list[str]:
    """The command of run_command, to start it another way."""
    return [
        sys.executable,
        "-m",
        "exporter",
        # Hydra's flags come before the overrides.
        *(["-m"] if multirun else []),
        f"mlflow.tracking_uri={tracking_uri_in(workdir)}",
        f"mlflow.artifact_location={workdir}/mlartifacts",
        f"cache_dir={workdir}/cache",
        # The benchmark stage runs and reports every figure on a short budget: the default's (up
        # to a second per live shape and runtime) adds up to 14 s to a job, and no test judges
        # how precise its timings are.
        *BRIEF_BENCHMARK,
        # Last, so a test can override the defaults above.
        *overrides,
    ]


def run_exporter(workdir: Path, *overrides: str) -> CliResult:
    """One job, its run dir inside `workdir`."""
    run_dir = workdir / "run"
    completed = run_command(workdir, f"hydra.run.dir={run_dir}", *overrides)
    output = completed.stdout + completed.stderr
    return CliResult(completed.returncode, output, run_dir, tracking_uri_in(workdir))


@dataclass
class SweepResult:
    exit_code: int
    output: str
    sweep_dir: Path
    tracking_uri: str

    def runs(self) -> list[Run]:
        return mlflow_runs(self.tracking_uri)

    def parent_and_children(self) -> tuple[Run, list[Run]]:
        """The sweep's parent run and the runs nested under it, in job order."""
        runs = self.runs()
        sweep_dir = str(self.sweep_dir)
        (parent,) = [r for r in runs if r.data.tags.get("sweep.dir") == sweep_dir]
        children = [r for r in runs if r.data.tags.get(MLFLOW_PARENT_RUN_ID) == parent.info.run_id]
        # A job's folder, which its `job` tag names, starts with its number.
        return parent, sorted(children, key=lambda run: int(run.data.tags["job"].split("-")[0]))


def run_sweep(workdir: Path, sweep_dir: Path, *overrides: str) -> SweepResult:
    """`-m`: a sweep into `sweep_dir`, its store and cache inside `workdir`."""
    completed = run_command(workdir, f"hydra.sweep.dir={sweep_dir}", *overrides, multirun=True)
    output = completed.stdout + completed.stderr
    return SweepResult(completed.returncode, output, sweep_dir, tracking_uri_in(workdir))


def run_stopped(
    overrides: list[str], marker: str, stop: Callable[[subprocess.Popen], object]
) -> tuple[int, str]:
    """`python -m exporter OVERRIDES...`, and `stop(process)` once a line of its output holds
    `marker`; the command's exit code and its whole output."""
    process = subprocess.Popen(
        [sys.executable, "-m", "exporter", *overrides],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            stop(process)
            break
    lines.append(process.stdout.read())
    return process.wait(timeout=300), "".join(lines)


@pytest.fixture
def exporter_cli(tmp_path: Path) -> Callable[..., CliResult]:
    """Each call runs the CLI in a fresh folder under tmp_path."""
    numbers = count()

    def run(*overrides: str) -> CliResult:
        workdir = tmp_path / f"job{next(numbers)}"
        workdir.mkdir()
        return run_exporter(workdir, *overrides)

    return run
