"""Where a job writes: a run dir of its own, and every place it writes checked before any work.

conf/config.yaml names run dirs and sweep dirs to the second, through `${new_dir:PATH}`: the
first job of a second takes PATH, a job started in the same second PATH-2, then PATH-3. The
name is claimed by creating the folder (os.mkdir, atomic on local and network file systems),
when Hydra first resolves it, so two processes never share one. A `hydra.run.dir` or
`hydra.sweep.dir` given on the command line is used as given, shared with any job given the
same. A sweep's jobs share its dir, each in a subdir named by its job number.

A run dir, cache or MLflow store that cannot be written is a configuration error (exit 2),
found before the job starts, naming the folder and the keys that move it. A single job whose
configuration is refused (a value the schema rejects, a place it cannot write) is refused
before its run dir is claimed, so it leaves none; its message goes to stderr, as Hydra's own.
"""

from __future__ import annotations

import copy
import os
from itertools import count
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from exporter.config import JobConfig, MlflowConfig, mlflow_of, to_job
from exporter.errors import ConfigError, DiskFull, stop_before_any_job
from exporter.tracking import server as tracking_server
from runtimes.files import NoRoom, write_refused

# The keys that put a job's outputs elsewhere: all three are under outputs/ by default.
MOVED_BY = (
    "hydra.run.dir=DIR (-m: hydra.sweep.dir=DIR), cache_dir=DIR and "
    "mlflow.tracking_uri=sqlite:///FILE (mlflow.artifact_location=DIR) move the job's outputs"
)


def new_dir(path: str) -> str:
    """PATH, or PATH-2, PATH-3, ...: the first of them that did not exist, created now. PATH
    itself where its parent cannot be written: the check of the run dir says so."""
    base = Path(path)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for number in count(1):
            candidate = base if number == 1 else base.with_name(f"{base.name}-{number}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return str(candidate)
    except OSError:
        pass
    return path


def register_resolver() -> None:
    """`${new_dir:PATH}` for conf/config.yaml; called by the command before Hydra composes."""
    # Cached: every later resolution of the same dir (Hydra resolves it more than once, in the
    # launcher and in each job of a sweep, which copy the cache) gives the name claimed first.
    OmegaConf.register_new_resolver("new_dir", new_dir, use_cache=True, replace=True)


def writable_dir(path: Path, what: str) -> None:
    """Creates `path` if it is missing; ConfigError unless this process can write in it, and
    DiskFull where its filesystem has no room left."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file, not a folder; {MOVED_BY}.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create {what} {path} ({error.strerror}); {MOVED_BY}.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write in {what} {path}; {MOVED_BY}.")
    if (number := write_refused(path)) is not None:
        raise DiskFull(NoRoom(number, what, path), "config")


def accepted(cfg: DictConfig) -> JobConfig:
    """The job's config, typed, with every place it writes checked; ConfigError otherwise."""
    job = to_job(cfg)
    check_job(job)
    return job


def check_job(job: JobConfig) -> None:
    """The cache and the MLflow store can be written."""
    if job.cache:
        writable_dir(Path(job.cache_dir), "the cache (cache_dir)")
    check_store(job.mlflow)


def check_store(mlflow: MlflowConfig) -> None:
    """The MLflow store's local folders can be written, or its tracking server answers."""
    if not mlflow.enabled:
        return
    uri = mlflow.tracking_uri
    if tracking_server.is_server(uri):
        # Asked before the job's worker would spend seconds importing mlflow to find that
        # nobody answers.
        tracking_server.probe(uri)
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        writable_dir(database.parent, "the MLflow store's folder (mlflow.tracking_uri)")
        if database.exists() and not os.access(database, os.W_OK):
            raise ConfigError(
                f"cannot write the MLflow store {database} (mlflow.tracking_uri); {MOVED_BY}."
            )
    artifacts = mlflow.artifact_location
    if artifacts and "://" not in artifacts:
        writable_dir(Path(artifacts), "MLflow's artifact folder (mlflow.artifact_location)")


class OutputsCallback(Callback):
    """Claims the run dir (or the sweep dir) and checks that it can be written, before Hydra
    creates it and starts logging there; a single job's configuration is checked first."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            accepted(_job_config(config))
            # The dir's name reads Hydra's choices (${hydra:runtime.choices.model}), which
            # resolve only once Hydra's config is set: Hydra sets it for the job after this
            # callback, to the same config. Resolving the dir claims it: only for a job that
            # starts.
            HydraConfig.instance().set_config(config)
            writable_dir(Path(config.hydra.run.dir), "the run dir (hydra.run.dir)")
        except ConfigError as error:
            # Hydra would print an exception's traceback.
            stop_before_any_job(error)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A sweep's jobs are composed by its launcher, one by one: each is checked as it starts
        # (a refused one is a FAILED job of the sweep); what they share is checked here.
        try:
            check_store(mlflow_of(config))
            writable_dir(Path(config.hydra.sweep.dir), "the sweep dir (hydra.sweep.dir)")
        except ConfigError as error:
            stop_before_any_job(error)


def _job_config(config: DictConfig) -> DictConfig:
    """The job's config as Hydra will hand it to the job: without the `hydra` node."""
    job = copy.deepcopy(config)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job
