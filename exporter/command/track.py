"""`python -m exporter track report=PATH [mlflow.tracking_uri=URI]`: attaches a target's report
(the report.json `python -m runtimes.check BUNDLE` writes) to the MLflow run of the job its
bundle came from, as a run nested under it and tagged with the target's device, so MLflow shows
the workstation's validation and the target's side by side: the same metrics at the same steps.

The child run is FINISHED when the target passed, FAILED when it failed or could not run the
artifact; the command exits 0 either way once it is attached, 2 for bad input (the message
names the file or key), 7 where the store cannot be written. A report attached before (the same
file's SHA-256 on a child of the job's run) is not attached again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from exporter.config import PROJECT_ROOT
from exporter.errors import ConfigError, ExporterError
from exporter.tracking import server as tracking_server
from exporter.tracking.record import OUTCOMES
from runtimes.verdict.report import Report

COMMAND = "track"
USAGE = f"python -m exporter {COMMAND} report=PATH [mlflow.tracking_uri=URI]"
KEYS = ("report", "mlflow.tracking_uri")
# The tag that tells one attached report from another.
REPORT_TAG = "target.report_sha256"
# Hydra's config groups: the source run's tags of these names are its choices (model, backend...).
_GROUPS = frozenset(path.name for path in (PROJECT_ROOT / "conf").iterdir() if path.is_dir())
# The fields of a report's `check` section read here (runtimes/check.py writes them).
_CHECK_FIELDS = ("source", "runtime", "device", "host", "started", "seconds", "exit_code")


@dataclass(frozen=True)
class TargetReport:
    """A target's report.json, read: the job's report part and the `check` section."""

    path: Path
    payload: Mapping[str, Any]
    sha256: str
    # When the check started, in MLflow's milliseconds.
    started_ms: int

    @property
    def check(self) -> Mapping[str, Any]:
        return self.payload["check"]

    @property
    def source(self) -> Mapping[str, Any]:
        return self.check["source"]

    @property
    def passed(self) -> bool:
        return self.payload.get("passed") is True


@dataclass(frozen=True)
class Attached:
    run_id: str
    parent_run_id: str
    parent_name: str
    experiment_id: str
    uri: str
    # False where the report had been attached before: `run_id` is that run.
    new: bool


def main(arguments: Sequence[str]) -> int:
    """The command's exit code: 0 attached, 2 bad input, 7 the store cannot be written."""
    if any(argument in ("-h", "--help") for argument in arguments):
        print(f"usage: {USAGE}\n{__doc__}")
        return 0
    try:
        options = _options(arguments)
        target = read(Path(options["report"]))
        attached = attach(target, options.get("mlflow.tracking_uri"))
    except ExporterError as error:
        print(f"[{COMMAND}] {error}", file=sys.stderr)
        return error.exit_code
    print(_describe(target, attached))
    return 0


def read(path: Path) -> TargetReport:
    """The target's report at `path`; ConfigError naming it where it is not one."""
    where = f"report={path}"
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{where}: cannot be read ({error.strerror})") from None
    try:
        payload = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{where} is not JSON ({error})") from None
    check = payload.get("check") if isinstance(payload, dict) else None
    if not isinstance(check, dict):
        raise ConfigError(
            f"{where} has no `check` section: it is not a target's report (a job's report.json "
            "is on its run already; python -m runtimes.check BUNDLE writes a target's)"
        )
    absent = [name for name in _CHECK_FIELDS if name not in check]
    if absent or not isinstance(check["source"], dict):
        raise ConfigError(f"{where}: its `check` section lacks {', '.join(absent or ['source'])}")
    try:
        started = datetime.fromisoformat(check["started"]).timestamp()
        float(check["seconds"])
    except (TypeError, ValueError) as error:
        times = "check.started (ISO time) or check.seconds"
        raise ConfigError(f"{where}: its {times} cannot be read ({error})") from None
    return TargetReport(path, payload, hashlib.sha256(data).hexdigest(), round(started * 1000))


def attach(target: TargetReport, tracking_uri: str | None = None) -> Attached:
    """Attaches `target` to its job's run in the store at `tracking_uri` (default: the one the
    job logged to) unless a child of that run has it already."""
    where = f"report={target.path}"
    run_id = target.source.get("run_id")
    if not run_id:
        raise ConfigError(
            f"{where}: the job its bundle came from ran with mlflow=off (check.source.run_id is "
            "null), so there is no MLflow run to attach it to"
        )
    uri = tracking_uri or target.source.get("tracking_uri")
    if not uri:
        raise ConfigError(f"{where} names no MLflow store; give mlflow.tracking_uri=URI")
    report = _job_report(target)
    # Imported once needed: mlflow takes seconds to load.
    from exporter.tracking import runs as tracking

    store, job_run = tracking.open_job_run(uri, run_id)
    name = job_run.info.run_name
    found = tracking.child_run_tagged(store, run_id, REPORT_TAG, target.sha256)
    if found is None:
        status = "FINISHED" if target.passed else "FAILED"
        found = tracking.log_target_run(
            store,
            run_id,
            f"{name} @ {target.check['host']} ({target.check['device']})",
            _tags(target, job_run.data.tags, status),
            report,
            float(target.check["seconds"]),
            target.path,
            status,
            target.started_ms,
        )
        return Attached(found, run_id, name, store.experiment_id, uri, new=True)
    return Attached(found, run_id, name, store.experiment_id, uri, new=False)


def _options(arguments: Sequence[str]) -> dict[str, str]:
    options = {}
    for argument in arguments:
        key, equals, value = argument.partition("=")
        if not equals:
            raise ConfigError(
                f"`{argument}` is not key=value; {COMMAND} takes {', '.join(KEYS)}: {USAGE}"
            )
        if key not in KEYS:
            raise ConfigError(
                f"`{key}` is not a key of {COMMAND}; it takes {', '.join(KEYS)}: {USAGE}"
            )
        options[key] = value
    if not options.get("report"):
        raise ConfigError(f"report= is required: {USAGE}")
    return options


def _job_report(target: TargetReport) -> Report | None:
    """The report part, as the job's validate stage writes it; None where the target could
    not load or run the artifact (the check's exit code 5), which has none."""
    if "executions" not in target.payload:
        return None
    try:
        return Report.from_json(target.payload)
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"report={target.path}: its validation report cannot be read "
            f"({type(error).__name__}: {error})"
        ) from None


def _tags(target: TargetReport, job_tags: Mapping[str, str], status: str) -> dict[str, str]:
    """The job's Hydra choices, so the runs filter together, and the target's: where it ran,
    what its runtime picked (`target.` as the job's own tags), its verdict and the report's
    identity."""
    check = target.check
    tags = {key: value for key, value in job_tags.items() if key in _GROUPS}
    picked = target.payload.get("target", {})
    tags.update({f"target.{key}": str(value) for key, value in picked.items()})
    tags.update(
        {
            "target.device": str(check["device"]),
            "target.host": str(check["host"]),
            "target.runtime": str(check["runtime"]),
            "status": OUTCOMES[status],
            "exit_code": str(check["exit_code"]),
            REPORT_TAG: target.sha256,
        }
    )
    if check.get("error"):
        tags["error"] = str(check["error"])[:5000]
        tags["mlflow.note.content"] = f"Failed on {check['host']}:\n\n{check['error']}"
    return tags


def _describe(target: TargetReport, attached: Attached) -> str:
    verdict = "passed" if target.passed else f"failed (exit code {target.check['exit_code']})"
    done = "attached" if attached.new else "was attached before (the same file's SHA-256)"
    base = attached.uri.rstrip("/") if tracking_server.is_server(attached.uri) else None
    ui = (
        f"open {base}"
        if base
        else f"run mlflow ui --backend-store-uri {attached.uri} and open http://127.0.0.1:5000"
    )
    return (
        f"[{COMMAND}] {target.path} ({verdict} on {target.check['host']}, device "
        f"{target.check['device']}) {done}: MLflow run {attached.run_id}, nested under the job's "
        f"run {attached.parent_run_id} ({attached.parent_name}) in {attached.uri}\n"
        f"[{COMMAND}] to see both: {ui}/#/experiments/{attached.experiment_id}"
        f"?workflowType=machine_learning and expand run {attached.parent_name}"
    )
