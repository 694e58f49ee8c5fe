"""The lines a job ends with, after everything else it logs: how it ended (passed, or where it
failed or was stopped, with its exit code; for a quantized model, whether fidelity or quality
failed), its worst error ratio, a quantized model's quality against the float model and its
speedup over eager, a KV-cache model's greedy generation beside the oracle's (and the float
model's), the layers whose quantization costs the most, where its files are, the link that
opens its MLflow run, and how long it took.

Whichever process concludes the job writes them (exporter/job/ending.py's `conclude`): the worker
for a job that ran, the command's process for a job refused by its configuration or whose
worker died.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from exporter.tracking import server as tracking_server
from exporter.tracking.comparison import JobSummary

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
    figures = summary.figures()
    if figures and len(_PREFIX + "; ".join(figures)) <= _WIDTH:
        figures = ["; ".join(figures)]
    return [
        _clipped(_PREFIX + _shouted(summary.outcome(exit_code))),
        *(_PREFIX + figure for figure in figures),
        *([_PREFIX + summary.greedy] if summary.greedy else []),
        *([_PREFIX + summary.quality_greedy] if summary.quality_greedy else []),
        *([_PREFIX + _costliest(summary.costliest_layers)] if summary.costliest_layers else []),
        f"{_PREFIX}run dir: {run_dir}",
        *([f"{_PREFIX}plots: {' '.join(plot.name for plot in plots)}"] if plots else []),
        *(_PREFIX + line for line in run_link),
        f"{_PREFIX}took {seconds:.1f} s",
    ]


def mlflow_run_lines(tracking_uri: str, experiment_id: str, run_id: str) -> list[str]:
    """Where the job's MLflow run opens in a browser: on the tracking server itself, or for a
    store of files or SQLite, on the UI that `mlflow ui` serves from it. The link's line may pass
    120 columns: a link cannot be wrapped."""
    # As model training: MLflow 3.17 opens a run as GenAI work otherwise (tracking.py).
    path = f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    if tracking_server.is_server(tracking_uri):
        return [f"MLflow run: {tracking_uri.rstrip('/')}/{path}"]
    return [
        f"MLflow run: {MLFLOW_UI}/{path}",
        f"  served by: mlflow ui --backend-store-uri {tracking_uri}",
    ]


def _costliest(layers: Sequence[str]) -> str:
    """The layers whose quantization costs the most quality, with the override that keeps them
    float (a link-like line: it may pass 120 columns, and is copied whole)."""
    return f"costliest layers quantized (quantize.attribution): quantize.skip=[{','.join(layers)}]"


def _shouted(outcome: str) -> str:
    """The outcome's first word in capitals (`PASSED`, `FAILED`, `KILLED`): the word a user
    looks for at the end of a long log."""
    word, rest = outcome.split(" ", 1)
    return f"{word.upper()} {rest}"


def _clipped(line: str) -> str:
    return line if len(line) <= _WIDTH else line[: _WIDTH - 1] + "…"
