"""The lines a job ends with, after everything else it logs: how it ended (passed, or where it
failed or was stopped, with its exit code), its worst error ratio and its speedup over eager,
where its files are, the link that opens its MLflow run, and how long it took.

Whichever process concludes the job writes them (exporter/record.py's `conclude`): the worker
for a job that ran, the command's process for a job refused by its configuration or whose
worker died.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

from exporter import tracking_server
from exporter.comparison import JobSummary

# `mlflow ui`'s address when started with no --host or --port.
MLFLOW_UI = "http://127.0.0.1:5000"
# What a line may hold after the log's `[12:00:00][INFO] ` prefix, on a 120-column terminal.
_WIDTH = 120 - len("[12:00:00][INFO] ")
_PREFIX = "[job] "


def lines(
    summary: JobSummary,
    exit_code: int,
    run_dir: Path,
    plots: Sequence[Path],
    run_link: Sequence[str],
    seconds: float,
) -> list[str]:
    """The job's closing lines; `run_link`: mlflow_run_lines' (none where tracking is off)."""
    figures = _figures(summary)
    if figures and len(_PREFIX + "; ".join(figures)) <= _WIDTH:
        figures = ["; ".join(figures)]
    return [
        _clipped(_PREFIX + _outcome(summary, exit_code)),
        *(_PREFIX + figure for figure in figures),
        f"{_PREFIX}run dir: {run_dir}",
        *([f"{_PREFIX}plots: {' '.join(plot.name for plot in plots)}"] if plots else []),
        *(_PREFIX + line for line in run_link),
        f"{_PREFIX}took {seconds:.1f} s",
    ]


def mlflow_run_lines(tracking_uri: str, experiment_id: str, run_id: str) -> list[str]:
    """Where the job's MLflow run opens in a browser: on the tracking server itself, or for a
    store of files or SQLite, on the UI that `mlflow ui` serves from it."""
    path = f"#/experiments/{experiment_id}/runs/{run_id}"
    if tracking_server.is_server(tracking_uri):
        return [f"MLflow run: {tracking_uri.rstrip('/')}/{path}"]
    return [
        f"MLflow run: {MLFLOW_UI}/{path}",
        f"  served by: mlflow ui --backend-store-uri {tracking_uri}",
    ]


def _outcome(summary: JobSummary, exit_code: int) -> str:
    code = f"(exit {exit_code})"
    if summary.status == "killed":
        stopped_by = signal.Signals(exit_code - 128).name if exit_code > 128 else "a signal"
        reason = f": {summary.error}" if summary.error else ""
        return f"KILLED {code} by {stopped_by} during the {summary.failed_stage} stage{reason}"
    if summary.status == "passed":
        shapes = f" at all {len(summary.shapes)} live shapes" if summary.shapes else ""
        # A job that passed whose MLflow run could not be written exits 7.
        tracking = "; its MLflow run was not written" if exit_code else ""
        return f"PASSED {code}{shapes}{tracking}"
    if summary.failed_stage == "validate" and summary.failed_shapes:
        why = (
            f"{len(summary.failed_shapes)} of {len(summary.shapes)} live shapes failed: "
            + ", ".join(summary.failed_shapes)
        )
    else:
        why = (summary.error or "").split("\n", 1)[0]
    return f"FAILED {code} at the {summary.failed_stage} stage: {why}"


def _figures(summary: JobSummary) -> list[str]:
    figures = []
    if summary.worst_error_ratio is not None:
        figures.append(
            f"worst error ratio {summary.worst_error_ratio:.3g} at {summary.worst_error_ratio_at} "
            "(artifact's error / eager's)"
        )
    speedups = summary.speedup_range()
    if speedups:
        figures.append(f"speedup over eager {speedups[0]:.3g}x..{speedups[1]:.3g}x")
    return figures


def _clipped(line: str) -> str:
    return line if len(line) <= _WIDTH else line[: _WIDTH - 1] + "…"
