"""Where jobs write: a run dir of each job's own however many start at once, MLflow runs that
hold only their job's files, and files that others can read as the umask says."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from exporter.cache.store import Cache
from exporter.config import PROJECT_ROOT as EXPORTER_ROOT
from exporter.config import MlflowConfig
from exporter.files import write_bytes
from exporter.job import outputs
from exporter.tracking import runs as tracking
from exporter.tracking.comparison import JobSummary
from exporter.tracking.record import JobRecord
from tests.conftest import (
    CONF_DIR,
    PROJECT_ROOT,
    command_line,
    empty_store,
    mlflow_runs,
    tracking_uri_in,
)

# Both jobs name their run dir alike, as two jobs of the same second do by default.
SAME_NAME = "mlp-eager"
# Imports what the command imports, then waits for the moment given, then runs the command:
# the two jobs compose their configs and claim their run dirs at the same instant.
RELEASED_TOGETHER = """
import sys, time
from exporter.command import cli
release = float(sys.argv[1])
sys.argv = ["exporter", *sys.argv[2:]]
time.sleep(max(0.0, release - time.time()))
cli.main()
"""


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    """Every file of the run's artifacts, as paths inside them."""
    found = []
    for info in client.list_artifacts(run_id, path):
        found += artifact_paths(client, run_id, info.path) if info.is_dir else [info.path]
    return found


def logged_files(run_dir: Path) -> list[str]:
    """The files of a run dir that its MLflow run holds: of its bundle, the manifest only."""
    files = (str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    return sorted(f for f in files if not f.startswith("bundle/") or f == "bundle/manifest.json")


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two model=mlp jobs under umask 022, released at the same instant, sharing a run dir
    name, a cache and an MLflow store; the folder that holds them."""
    workdir = tmp_path_factory.mktemp("together")
    overrides = [
        "model=mlp",
        "backend=eager",
        "benchmark=off",
        f"hydra.run.dir=${{new_dir:{workdir}/runs/{SAME_NAME}}}",
    ]
    command = command_line(workdir, *overrides)
    release = time.time() + 8
    processes = [
        subprocess.Popen(
            # The command line without `python -m exporter`.
            [sys.executable, "-c", RELEASED_TOGETHER, str(release), *command[3:]],
            cwd=PROJECT_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            umask=0o022,
        )
        for _ in range(2)
    ]
    output = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], output
    return workdir


def test_two_jobs_started_at_once_get_two_run_dirs_each_with_its_own_files(two_jobs) -> None:
    workdir = two_jobs
    run_dirs = sorted((workdir / "runs").iterdir())
    assert [d.name for d in run_dirs] == [SAME_NAME, f"{SAME_NAME}-2"]
    for run_dir in run_dirs:
        log = (run_dir / "exporter.log").read_text()
        assert log.count("[config] started") == 1, log
        assert log.count("[validate] passed at all 7 live shapes") == 1, log
        assert OmegaConf.load(run_dir / "summary.json").job == run_dir.name
        assert (run_dir / "report.json").is_file()
        assert not list(run_dir.rglob(".partial-*"))


def test_each_mlflow_run_holds_its_own_job_files_and_no_partial_file(two_jobs) -> None:
    workdir = two_jobs
    client = MlflowClient(tracking_uri_in(workdir))
    runs = mlflow_runs(tracking_uri_in(workdir))
    assert len(runs) == 2
    logged_dirs = set()
    for run in runs:
        paths = artifact_paths(client, run.info.run_id)
        assert not [path for path in paths if ".partial-" in path], paths
        summary = Path(client.download_artifacts(run.info.run_id, "summary.json"))
        run_dir = workdir / "runs" / OmegaConf.load(summary).job
        assert sorted(paths) == logged_files(run_dir)
        assert summary.read_text() == (run_dir / "summary.json").read_text()
        # The log as it was when the run's files were logged: the line saying so comes after.
        logged = Path(client.download_artifacts(run.info.run_id, "exporter.log")).read_text()
        assert (run_dir / "exporter.log").read_text().startswith(logged)
        logged_dirs.add(run_dir.name)
    assert logged_dirs == {SAME_NAME, f"{SAME_NAME}-2"}


def test_under_umask_022_every_file_is_readable_and_every_folder_traversable(two_jobs) -> None:
    workdir = two_jobs
    # The run dirs, the cache both jobs filled, MLflow's copies of the files, its database.
    folders = [workdir / "runs", workdir / "cache", workdir / "mlartifacts"]
    private = [
        f"{path} {stat.filemode(path.stat().st_mode)}"
        for folder in folders
        for path in [folder, *folder.rglob("*")]
        if stat.S_IMODE(path.stat().st_mode) != (0o755 if path.is_dir() else 0o644)
    ]
    assert not private
    assert stat.S_IMODE((workdir / "mlflow.db").stat().st_mode) == 0o644
    assert len(list((workdir / "cache").glob("*/*/manifest.json"))) >= 2


def test_atomic_writes_and_cache_entries_follow_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        written = write_bytes(tmp_path / "report.json", b"{}")
        entry, hit = Cache(tmp_path / "cache").fetch(
            "lower", {"k": 1}, lambda folder: (folder / "model.pte").write_bytes(b"pte")
        )
    finally:
        os.umask(previous)
    assert not hit
    assert stat.S_IMODE(written.stat().st_mode) == 0o640
    assert stat.S_IMODE(entry.stat().st_mode) == 0o750
    assert stat.S_IMODE((entry / "manifest.json").stat().st_mode) == 0o640


@pytest.mark.parametrize(("mode", "folder"), [("run", "runs"), ("sweep", "sweeps")])
def test_jobs_of_the_same_second_get_the_default_dir_and_the_next_name(
    tmp_path: Path, mode: str, folder: str
) -> None:
    """The default config's run dir (sweep dir), resolved for two commands that see the same
    time."""
    outputs.register_resolver()
    OmegaConf.register_new_resolver("project_root", lambda: str(tmp_path), replace=True)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            first, second = (
                compose("config", ["model=mlp", "backend=eager"], return_hydra_config=True)
                for _ in range(2)
            )
        HydraConfig.instance().set_config(first)
        first_dir = Path(first.hydra[mode].dir)
        # Hydra's `now` is read once per config: the second job reads the first one's second.
        OmegaConf.get_cache(second)["now"].update(OmegaConf.get_cache(first)["now"])
        HydraConfig.instance().set_config(second)
        second_dir = Path(second.hydra[mode].dir)
    finally:
        HydraConfig.instance().cfg = None
        OmegaConf.register_new_resolver("project_root", lambda: str(EXPORTER_ROOT), replace=True)
    assert first_dir.parent.parent == tmp_path / "outputs" / folder
    assert second_dir == first_dir.with_name(f"{first_dir.name}-2")
    assert first_dir.is_dir()
    assert second_dir.is_dir()


def test_the_run_start_check_claims_the_default_run_dir_before_hydra_sets_its_config(
    tmp_path: Path,
) -> None:
    """Hydra calls on_run_start before it sets its own config; the default run dir's name reads
    Hydra's choices (the model and backend), which the callback must resolve all the same,
    without the warning Hydra prints for a callback that raises."""
    outputs.register_resolver()
    OmegaConf.register_new_resolver("project_root", lambda: str(tmp_path), replace=True)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", ["model=mlp", "backend=eager"], return_hydra_config=True)
        HydraConfig.instance().cfg = None
        outputs.OutputsCallback().on_run_start(cfg)
        # As Hydra resolves it for the job, after setting its config.
        HydraConfig.instance().set_config(cfg)
        run_dir = Path(cfg.hydra.run.dir)
    finally:
        HydraConfig.instance().cfg = None
        OmegaConf.register_new_resolver("project_root", lambda: str(EXPORTER_ROOT), replace=True)
    (day,) = (tmp_path / "outputs" / "runs").iterdir()
    (claimed,) = day.iterdir()
    assert claimed.name.endswith("-mlp-eager")
    # Hydra resolves the same name for the job: the claim is not made twice.
    assert run_dir == claimed


def test_a_partial_file_in_the_run_dir_is_not_logged(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_bytes(run_dir / "report.json", b"{}")
    # What a writer still writing (or killed mid-write) leaves beside the job's files.
    (run_dir / ".partial-1234-latency_vs_size.png").write_bytes(b"half")
    # A store with its tables made, as every job's but a store's first finds it.
    shutil.copyfile(empty_store(), tmp_path / "mlflow.db")
    store = tracking.open_store(
        MlflowConfig(
            enabled=True,
            tracking_uri=tracking_uri_in(tmp_path),
            artifact_location=str(tmp_path / "artifacts"),
        )
    )
    record = JobRecord(run_dir=run_dir)
    run_id = tracking.start_run(store, "run", record.started_ms, {}, {})
    tracking.end_run(store, run_id, record, JobSummary.of(record, {}))
    assert artifact_paths(store.client, run_id) == ["report.json"]


def refused(workdir: Path, *overrides: str, user: list[str] = ()) -> tuple[int, str]:
    """`python -m exporter model=mlp OVERRIDES` (as `user`, a command prefix, where given): its
    exit code and output."""
    command = [*user, *command_line(workdir, "model=mlp", *overrides)]
    completed = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True)
    return completed.returncode, completed.stdout + completed.stderr


@pytest.mark.parametrize(
    ("key", "value", "folder"),
    [
        ("hydra.run.dir", "{file}/run", "the run dir (hydra.run.dir) {file}"),
        ("cache_dir", "{file}/cache", "the cache (cache_dir) {file}"),
        ("mlflow.tracking_uri", "sqlite:///{file}/mlflow.db", "(mlflow.tracking_uri) {file}"),
    ],
)
def test_a_place_that_cannot_be_written_exits_2_naming_it_and_the_keys(
    tmp_path: Path, key: str, value: str, folder: str
) -> None:
    # A regular file where a folder should be: root, whom permission bits do not stop, cannot
    # create folders in it either.
    file = tmp_path / "outputs"
    file.write_text("")
    overrides = [f"hydra.run.dir={tmp_path}/run", f"{key}={value.format(file=file)}"]
    exit_code, output = refused(tmp_path, *overrides)
    assert exit_code == 2, output
    assert folder.format(file=file) in output
    for moving in ("hydra.run.dir=DIR", "cache_dir=DIR", "mlflow.tracking_uri=sqlite:///FILE"):
        assert moving in output
    assert "Traceback" not in output
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists(),
    reason="runs the command as nobody, which needs root and setpriv",
)
def test_a_read_only_outputs_folder_exits_2_for_a_user_whom_permissions_stop() -> None:
    # A folder of root's that others may enter but not write, as a shared read-only outputs/.
    root = Path(tempfile.mkdtemp(prefix="exporter-read-only-"))
    try:
        root.chmod(0o555)
        nobody = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        # The job's cache and store are checked before its run dir: here only the run dir.
        run_dir = f"hydra.run.dir={root}/outputs/run"
        exit_code, output = refused(root, "cache=off", "mlflow=off", run_dir, user=nobody)
    finally:
        shutil.rmtree(root)
    assert exit_code == 2, output
    assert f"cannot create the run dir (hydra.run.dir) {root}/outputs/run (Permission denied)" in (
        output
    )
    assert "Traceback" not in output
