"""A job's work runs in a worker process of its own; the command's process watches it.

A crash inside native code (a segfault in a delegate's kernels, an abort, the kernel's
out-of-memory killer) ends the process it happens in, with no chance to write the job's
record. So the command's process, which stays small (no torch), starts the job in a worker,
follows how far it got (its MLflow run, its stage), and when the worker dies without concluding
the job, concludes it: the summary in the run dir names the stage and the signal, the MLflow run
is closed FAILED (KILLED when the command was asked to stop), the exit code is the stage's, and
the worker's partial files and cache staging folders are removed.

Ctrl-C and SIGTERM (a scheduler's stop) reach the worker through this process, which forwards
them: the worker runs in a process group of its own, so a terminal's Ctrl-C arrives there once.
Slurm's warning that a job's time limit is near (exporter/process/slurm.py) stops neither: the
job runs on until Slurm's SIGTERM, and its run then says that the time limit stopped it.
A configuration the schema rejects, or a tracking server that does not answer, is answered
before any worker starts: a single job's before its run dir is claimed (exporter/job/outputs.py),
a sweep's job here, as a FAILED job of the sweep.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import pickle
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf

from exporter import config
from exporter.cache.store import Cache
from exporter.config import PROJECT_ROOT
from exporter.errors import STAGE_ERRORS, ConfigError, DiskFull
from exporter.files import write_bytes
from exporter.job import outputs
from exporter.job.ending import conclude, keep_traceback, open_run
from exporter.process import interrupts, memory, slurm
from exporter.tracking.record import JobContext, JobRecord
from runtimes import native_log
from runtimes.files import PARTIAL_PREFIX, NoRoom

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"

# Signals that stop a job: forwarded to the worker, and the job ends KILLED.
_STOPS = (signal.SIGINT, signal.SIGTERM)
# OpenMP's threads (torch's intra-op pool) spin while they wait for work by default. On cores
# that other processes use too (a parallel sweep's other jobs, anyone's work on a shared
# machine) the spinning takes the time slices the work needs: on a shared 2-core machine eager
# tiny Llama took 24 ms at seq 1 (0.5 ms with waits that sleep) and the goldens 1.1-1.7 s
# (0.1 s). A user's own setting wins.
_THREAD_WAITS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Signals of a crash, after which native.log ends with Python's fault handler's stack (most
# recent call first) and whatever native code said before; a SIGKILL leaves no last words.
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT}
# The lines of native.log a crash shows on the terminal: its error and the innermost frames.
_LAST_WORDS = 12


@dataclass
class _Progress:
    """What the worker said: its MLflow run, its stage, and its exit code once it concluded."""

    run_id: str | None = None
    stage: str | None = None
    exit_code: int | None = None

    def follow(self, events: IO[str]) -> None:
        """Reads the worker's events, a JSON pair a line, until it closes its end (it ended,
        or died)."""
        for line in events:
            kind, value = json.loads(line)
            setattr(self, kind, value)


def run(cfg: DictConfig, context: JobContext, logging_config: dict[str, Any]) -> int:
    """Runs the job in a worker and returns its exit code. `logging_config`: the job's logging
    (Hydra's job_logging, resolved), which the worker sets up as the command's process has.

    Hydra's composed config goes no further than here: the run dir gets it as config.yaml, the
    MLflow run as its params (flattened), and the job's frame below gets the typed job."""
    record = JobRecord(run_dir=context.run_dir, started_ms=context.started_ms)
    params = config.flatten(cfg)
    try:
        job = outputs.accepted(cfg)
        config_yaml = OmegaConf.to_yaml(cfg, resolve=True).encode()
        write_bytes(context.run_dir / CONFIG_FILE, config_yaml, "the job's config")
    except ConfigError as error:
        return _refused(cfg, params, context, record, error)
    except NoRoom as no_room:
        return _refused(cfg, params, context, record, DiskFull(no_room, "config"))
    progress = _Progress()
    read_end, write_end = os.pipe()
    with _forwarded() as stops:
        # Slurm sends its warning to every process of the job: the worker ignores it (an ignored
        # signal stays ignored across exec; a handler would not).
        signal.signal(slurm.TIME_LIMIT_WARNING, signal.SIG_IGN)
        # A plain subprocess, not multiprocessing: under a launcher's worker (joblib's loky) a
        # multiprocessing child inherits a start method it cannot resolve.
        worker = subprocess.Popen(
            [sys.executable, "-m", __name__, str(write_end)],
            stdin=subprocess.PIPE,
            pass_fds=[write_end],
            # Its own process group: a terminal's Ctrl-C reaches it once, through this process.
            process_group=0,
            # This process's exporter, whatever the worker's cwd and installed copies.
            env={**_THREAD_WAITS, **os.environ, "PYTHONPATH": _python_path()},
        )
        signal.signal(slurm.TIME_LIMIT_WARNING, _time_limit_near)
        stops.forward_to(worker)
        os.close(write_end)
        assert worker.stdin is not None
        with worker.stdin:
            pickle.dump((job, params, context, logging_config), worker.stdin)
        with os.fdopen(read_end) as events:
            progress.follow(events)
        worker.wait()
    if progress.exit_code is not None:
        return progress.exit_code
    return _died(job, params, context, record, worker, progress, stops.received)


def _work(events_fd: int) -> None:
    """The worker: the job's stages, its record and its MLflow run."""
    job, params, context, logging_config = pickle.load(sys.stdin.buffer)
    logging.config.dictConfig(logging_config)
    # Python's warnings (torch.export's among them) go to the job's log, not to stderr alone.
    logging.captureWarnings(True)
    interrupts.defer()
    memory.collect_less_often()
    from exporter.job import pipeline

    with os.fdopen(events_fd, "w", buffering=1) as events:

        def notify(kind: str, value: object) -> None:
            events.write(json.dumps([kind, value]) + "\n")

        # Native libraries' lines go to the run dir: the terminal gets the job's log.
        with native_log.routed_to(context.run_dir / native_log.NATIVE_LOG):
            exit_code = pipeline.run(job, params, context, notify)
        notify("exit_code", exit_code)
    sys.exit(exit_code)


def _python_path() -> str:
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(filter(None, [str(PROJECT_ROOT), inherited]))


class _Stops:
    """The SIGINT and SIGTERM this process receives while its worker runs, passed on to it (or
    once it exists, for one that came before)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.worker: subprocess.Popen | None = None

    def receive(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        if self.worker is not None:
            self.worker.send_signal(signum)

    def forward_to(self, worker: subprocess.Popen) -> None:
        self.worker = worker
        for signum in self.received:
            worker.send_signal(signum)


@contextlib.contextmanager
def _forwarded() -> Iterator[_Stops]:
    """Stops forwarded to the worker while it runs, and Slurm's time-limit warning taken out of
    submitit's hands (its handler raises wherever this process is, leaving the job's run open
    and failing the whole sweep); the previous handlers come back after."""
    stops = _Stops()
    previous = {signum: signal.signal(signum, stops.receive) for signum in _STOPS}
    previous[slurm.TIME_LIMIT_WARNING] = signal.getsignal(slurm.TIME_LIMIT_WARNING)
    try:
        yield stops
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _time_limit_near(signum: int, frame: object) -> None:
    log.warning(
        "Slurm says that job %s nears its time limit (%s); it runs on until Slurm stops it",
        slurm.job_id(),
        signal.Signals(signum).name,
    )


def _refused(
    cfg: DictConfig,
    params: dict[str, str],
    context: JobContext,
    record: JobRecord,
    error: ConfigError,
) -> int:
    """A config the schema rejects, or a run dir too full for it: nothing runs. A job of a
    sweep still gets its run dir and FAILED run, so the sweep's comparison has every job; a
    single job, refused here only where its config changed since it was checked (a tracking
    server that stopped answering, a disk that filled), records no run."""
    record.error = error
    log.error("[%s] %s", error.stage, error)
    keep_traceback(error, context.run_dir)
    store = run_id = None
    if context.parent_run_id:
        try:
            # The MLflow settings alone: a config refused for another value still has them.
            mlflow = config.mlflow_of(cfg)
        except ConfigError as problem:
            log.error("[%s] %s", problem.stage, problem)
        else:
            store, run_id = open_run(mlflow, params, context, record)
    return conclude(record, context, store, run_id)


def _died(
    job: config.JobConfig,
    params: dict[str, str],
    context: JobContext,
    record: JobRecord,
    worker: subprocess.Popen,
    progress: _Progress,
    stops: list[int],
) -> int:
    """Concludes the job of a worker that ended without concluding it."""
    # A worker that dies before its first stage could not start the job here (its own error
    # is above it): a problem of this machine's setup, as the config stage finds them.
    record.stage = progress.stage or "config"
    where = f"during the {progress.stage} stage" if progress.stage else "before its first stage"
    if stops:
        record.stopped_by = stops[0]
        record.stop_reason = slurm.stop_reason(stops[0])
        log.error("[%s] %s", record.stage, record.stop_reason)
    else:
        failure = STAGE_ERRORS[record.stage]
        record.error = failure(
            f"the job's process {_death(worker.returncode)} {where}; its log in {context.run_dir} "
            f"ends where it stopped, and {native_log.NATIVE_LOG} there with what native code and "
            "Python's fault handler said last."
        )
        log.error("[%s] %s", record.error.stage, record.error)
        if worker.returncode is not None and -worker.returncode in _CRASHES:
            last = native_log.last_words(context.run_dir / native_log.NATIVE_LOG, _LAST_WORDS)
            log.error("[%s] the end of %s:\n%s", record.stage, native_log.NATIVE_LOG, last)
    _remove_partial_files(job, context.run_dir, worker.pid)
    store, run_id = open_run(job.mlflow, params, context, record, progress.run_id)
    return conclude(record, context, store, run_id)


def _death(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode} without recording how the job ended"
    name = signal.Signals(-exitcode).name
    if -exitcode == signal.SIGKILL:
        return f"was killed ({name}; the kernel's out-of-memory killer sends it: see dmesg)"
    return f"crashed ({name})"


def _remove_partial_files(job: config.JobConfig, run_dir: Path, pid: int | None) -> None:
    """What a worker killed mid-write leaves: its run dir's partial files, and its staging
    folders in the cache."""
    for path in run_dir.glob(f"{PARTIAL_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if job.cache and pid is not None:
        Cache(Path(job.cache_dir)).remove_staging_of(pid)


if __name__ == "__main__":
    _work(int(sys.argv[1]))
