"""A sweep (`python -m exporter -m ...`): its parent MLflow run and the comparison of its jobs.

Hydra calls SweepCallback in the process that launches the sweep. It opens the parent run
before any job starts and writes its id to sweep.json in the sweep dir, with the keys whose
values the sweep varies, where every job finds them, in whatever process or machine the
launcher runs it: a job's run is named by its values of those keys (`fallback=strict`). When
the jobs have ended it reads their summaries back from the sweep dir, writes the comparison
beside them, logs it on the parent run and closes the run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from exporter.config import mlflow_of
from exporter.errors import ExporterError, stop_before_any_job
from exporter.files import write_json
from exporter.tracking import comparison
from exporter.tracking.record import OUTCOMES, now_ms

if TYPE_CHECKING:
    from exporter.tracking.runs import Store

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
# Where Hydra keeps a job's overrides, in its folder.
_JOB_OVERRIDES = Path(".hydra") / "overrides.yaml"
# MLflow's SQL stores keep a run's name in 250 characters.
_MAX_RUN_NAME = 250
# A job that left no summary ended without a word: the sweep still exits non-zero.
_NO_RESULT_EXIT_CODE = 1
_LOST = (
    "the job's process ended without recording how the job ended (killed, or its node failed); "
    "its launcher's log says more (.submitit/ in the sweep dir for submitit)"
)


@dataclass
class _Sweep:
    dir: Path
    overrides: str
    store: Store | None
    parent_run_id: str | None


# The sweep this process launched and not yet finished, and the exit codes of those it has:
# Hydra gives the command's entrypoint no result of a multirun.
_active: list[_Sweep] = []
_exit_codes: list[int] = []


def exit_codes() -> list[int]:
    return list(_exit_codes)


def launched() -> bool:
    return bool(_active or _exit_codes)


def parent_run_id(sweep_dir: Path, tracking_uri: str) -> str | None:
    """The sweep's parent run, for a job of it that tracks to the same store."""
    path = sweep_dir / SWEEP_FILE
    if not path.exists():
        return None
    sweep = json.loads(path.read_text())
    return sweep["parent_run_id"] if sweep["tracking_uri"] == tracking_uri else None


def job_run_name(sweep_dir: Path, job_overrides: Sequence[str]) -> str | None:
    """A job's run name: its values of the keys the sweep varies (`fallback=strict`,
    `backend=aoti model=mlp`), in the order the command gave them; None where the sweep varies
    nothing (one job) or has not said which keys it varies."""
    path = sweep_dir / SWEEP_FILE
    if not path.exists():
        return None
    varying = json.loads(path.read_text()).get("varying", [])
    own = {_key(override): override for override in _parsed(job_overrides)}
    named = [f"{key}={own[key].get_value_element_as_str()}" for key in varying if key in own]
    return " ".join(named)[:_MAX_RUN_NAME] or None


def _job_run_name(sweep_dir: Path, job: str) -> str:
    """The run name of the sweep's job in folder `job`, from the overrides Hydra kept there."""
    path = sweep_dir / job / _JOB_OVERRIDES
    overrides = list(OmegaConf.load(path)) if path.exists() else []
    return job_run_name(sweep_dir, overrides) or job


def _sweep_overrides(config: DictConfig) -> list[str]:
    """The sweep's overrides: the sweeper's `params` from the config, then the command's."""
    params: Mapping[str, Any] = config.hydra.sweeper.get("params") or {}
    return [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)


def _parsed(overrides: Iterable[str]) -> list[Override]:
    return OverridesParser.create().parse_overrides(list(overrides))


def _key(override: Override) -> str:
    # Without `+` or `~`: a job's `+key=1` and the sweep's `+key=1,2` name the same key.
    package = f"@{override.package}" if override.package else ""
    return f"{override.key_or_group}{package}"


def finish_interrupted() -> None:
    """Ctrl-C stopped the sweep: compare the jobs that ended and close the parent as KILLED."""
    if _active:
        _finish(_active.pop(), interrupted=True)


def finish_failed_launch() -> bool:
    """The launcher failed after its jobs ran (submitit raises for a Slurm job that died
    without its result, killed or on a failed node): the sweep ends as when it completes, the
    dead jobs as "no result". False where no sweep was running."""
    if not _active:
        return False
    _finish(_active.pop(), interrupted=False, launcher_failed=True)
    return True


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        overrides = " ".join(config.hydra.overrides.task)
        swept = [o for o in _parsed(_sweep_overrides(config)) if o.is_sweep_override()]
        varying = list(dict.fromkeys(_key(override) for override in swept))
        store = parent = None
        try:
            # Its settings and store were checked before the sweep dir was claimed
            # (exporter/job/outputs.py).
            mlflow = mlflow_of(config)
            if mlflow.enabled:
                # Imported only where tracking is on: mlflow=off never imports mlflow.
                from exporter.tracking import runs as tracking

                # Creating the store and experiment here, once, keeps parallel jobs from racing
                # to create them.
                store = tracking.open_store(mlflow)
                tags = {"sweep.overrides": overrides, "sweep.dir": str(sweep_dir)}
                # What the sweep varies names it (its time is the run's own).
                name = " ".join(["sweep", *(override.input_line for override in swept)])
                parent = tracking.start_run(store, name[:_MAX_RUN_NAME], now_ms(), {}, tags)
        except ExporterError as error:
            stop_before_any_job(error)
        write_json(
            sweep_dir / SWEEP_FILE,
            {
                "parent_run_id": parent,
                "tracking_uri": mlflow.tracking_uri,
                "overrides": overrides,
                "varying": varying,
            },
        )
        _active.append(_Sweep(sweep_dir, overrides, store, parent))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _finish(_active.pop(), interrupted=False)


def _finish(sweep: _Sweep, interrupted: bool, launcher_failed: bool = False) -> None:
    summaries = comparison.collect(sweep.dir)
    title = f"Sweep {sweep.dir.parent.name}/{sweep.dir.name}: {sweep.overrides}"
    files = comparison.write(summaries, title, sweep.dir)
    failed = [s for s in summaries if s.status != "passed"]
    codes = [_NO_RESULT_EXIT_CODE if s.exit_code is None else s.exit_code for s in summaries]
    # A launcher that failed may have run no job at all (sbatch refused them): not a pass.
    exit_code = 130 if interrupted else max(codes, default=0) or int(launcher_failed)
    _exit_codes.append(exit_code)
    if sweep.store is None or sweep.parent_run_id is None:
        _log_jobs(summaries, sweep.dir / comparison.HTML_FILE)
        return
    from exporter.tracking import runs as tracking

    if not interrupted:
        # Every job has ended: a run still open belongs to a job whose process died.
        for lost in (s for s in summaries if s.exit_code is None):
            try:
                tracking.fail_lost_job_run(sweep.store, sweep.parent_run_id, lost.job, _LOST)
            except ExporterError as error:
                log.error("[%s] %s", error.stage, error)
    status = "KILLED" if interrupted else ("FAILED" if failed or launcher_failed else "FINISHED")
    note = "\n".join(f"- {_job_run_name(sweep.dir, s.job)}: {s.verdict()}" for s in summaries)
    tags = {
        "status": OUTCOMES[status],
        "exit_code": str(exit_code),
        "mlflow.note.content": f"{len(summaries)} jobs, {len(failed)} did not pass:\n\n{note}",
    }
    metrics = {
        "jobs": len(summaries),
        "jobs_passed": len(summaries) - len(failed),
        "jobs_failed": len(failed),
    }
    # The sweep's worst, in the columns where its jobs show their own.
    speedups = [s.worst_speedup_vs_eager for s in summaries if s.worst_speedup_vs_eager]
    ratios = [s.worst_error_ratio for s in summaries if s.worst_error_ratio is not None]
    if speedups:
        metrics["worst_speedup_vs_eager"] = min(speedups)
    if ratios:
        metrics["worst_error_ratio"] = max(ratios)
    files.append(sweep.dir / SWEEP_FILE)
    try:
        tracking.end_sweep_run(sweep.store, sweep.parent_run_id, status, metrics, tags, files)
    except ExporterError as error:
        log.error("[%s] %s", error.stage, error)
        _exit_codes.append(error.exit_code)
    _log_jobs(summaries, sweep.dir / comparison.HTML_FILE)


def _log_jobs(summaries: list[comparison.JobSummary], page: Path) -> None:
    """The sweep's last lines: its jobs, a row each (how each ended, its worst error ratio, its
    speedup range over eager, its seconds), and where the comparison is."""
    passed = sum(summary.status == "passed" for summary in summaries)
    log.info(
        "[sweep] %d jobs, %d passed, %d did not:\n%s",
        len(summaries),
        passed,
        len(summaries) - passed,
        comparison.text(summaries),
    )
    log.info("[sweep] comparison: %s", page)
