"""The comparison's plots against live size, one line per job: worst error, the benchmark's
latency (median, with bars from its 10th to its 90th percentile) and its speedup over eager.

Each dynamic dim gets an axis of its own, its sizes along x in order: a model with batch and
seq has two panels, each point a live shape placed by that dim's size. A model with a KV cache
has one, its judged steps placed by their position, a line per session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from exporter.files import atomic_path
from exporter.tracking.comparison.summary import JobSummary

ERROR_PLOT = "max_abs_err_vs_size.png"
LATENCY_PLOT = "latency_vs_size.png"
SPEEDUP_PLOT = "speedup_vs_eager_vs_size.png"

# Per live shape of a job: (value, below, above), the bar reaching from value - below to
# value + above; None where the job has no value at that shape.
Points = list[tuple[float, float, float] | None]
# The step of a session (`session=0,pos=7,seq=1`) that places it along x.
POSITION = "pos"
# A job's sessions in one colour, told apart by their lines and markers.
_SESSION_LINES = ("-", "--", ":", "-.")
_SESSION_MARKERS = ("o", "s", "^", "D")


def write_plots(summaries: Sequence[JobSummary], labels: Sequence[str], folder: Path) -> list[Path]:
    """The error plot of the jobs that got as far as validation, and the latency and speedup
    plots of those the benchmark timed; none where no job got that far."""
    validated = [(s, label) for s, label in zip(summaries, labels, strict=True) if s.shapes]
    timed = [(s, label) for s, label in validated if s.latency_ms]
    compared = [(s, label) for s, label in timed if any(x is not None for x in s.speedup_vs_eager)]
    plots = (
        (validated, ERROR_PLOT, "max abs error vs eager float64", "max_abs_err", _errors, None),
        (
            timed,
            LATENCY_PLOT,
            "latency (ms): median, bars p10 to p90",
            "latency_ms",
            _latency,
            None,
        ),
        (
            compared,
            SPEEDUP_PLOT,
            "speedup vs eager (eager's median over the artifact's; above 1: faster)",
            "speedup_vs_eager",
            _speedup,
            1.0,
        ),
    )
    return [
        _plot(jobs, title, series, points, baseline, folder / name)
        for jobs, name, title, series, points, baseline in plots
        if jobs
    ]


def _errors(summary: JobSummary) -> Points:
    return [(value, 0.0, 0.0) for value in summary.max_abs_err]


def _latency(summary: JobSummary) -> Points:
    return [
        (median, median - p10, p90 - median)
        for median, p10, p90 in zip(
            summary.latency_ms, summary.latency_p10_ms, summary.latency_p90_ms, strict=True
        )
    ]


def _speedup(summary: JobSummary) -> Points:
    return [None if value is None else (value, 0.0, 0.0) for value in summary.speedup_vs_eager]


def _axes(summary: JobSummary) -> list[str]:
    """The dims a job's shapes are placed by: each dynamic dim, or a session's position."""
    first = summary.shapes[0]
    return [POSITION] if "session" in first else list(first)


def _lines(
    summary: JobSummary, label: str, points_of: Callable[[JobSummary], Points]
) -> list[tuple[str, list[dict[str, int]], Points]]:
    """A job's lines, each its name, shapes and points: one, or one per session of a model with
    a KV cache (`label session 0`)."""
    points = points_of(summary)
    if "session" not in summary.shapes[0]:
        return [(label, summary.shapes, points)]
    sessions = dict.fromkeys(shape["session"] for shape in summary.shapes)
    return [
        (
            f"{label} session {session}",
            [shape for shape in summary.shapes if shape["session"] == session],
            [
                p
                for shape, p in zip(summary.shapes, points, strict=True)
                if shape["session"] == session
            ],
        )
        for session in sessions
    ]


def _plot(
    measured: Sequence[tuple[JobSummary, str]],
    title: str,
    series: str,
    points_of: Callable[[JobSummary], Points],
    baseline: float | None,
    path: Path,
) -> Path:
    """`baseline`: a value to draw a dashed line at (a speedup of 1)."""
    # A bare Figure, not pyplot: no global state and no display, so jobs can plot in parallel.
    # Imported here: a job that ends before validation draws nothing and need not load it.
    from matplotlib.figure import Figure

    dims = list(dict.fromkeys(dim for summary, _ in measured for dim in _axes(summary)))
    figure = Figure(figsize=(7 * len(dims), 4.5), layout="constrained")
    for panel, dim in enumerate(dims, start=1):
        axes = figure.add_subplot(1, len(dims), panel)
        for number, (summary, label) in enumerate(measured):
            if dim not in _axes(summary):
                # A job of another model, without this dim (a KV cache's steps have a `seq`,
                # the tokens in the call, but are placed by position alone).
                continue
            for line, (name, shapes, points) in enumerate(_lines(summary, label, points_of)):
                placed = sorted(
                    (shape[dim], *point)
                    for shape, point in zip(shapes, points, strict=True)
                    if point is not None
                )
                if not placed:
                    continue
                x, y, below, above = zip(*placed, strict=True)
                # A job keeps its colour in every panel.
                style = {
                    "marker": _SESSION_MARKERS[line % len(_SESSION_MARKERS)],
                    "capsize": 3,
                    "color": f"C{number % 10}",
                    "linestyle": _SESSION_LINES[line % len(_SESSION_LINES)],
                    "label": name,
                }
                axes.errorbar(x, y, yerr=[below, above], **style)
        if baseline is not None:
            axes.axhline(baseline, color="grey", linestyle="--", linewidth=1)
        # Errors, latencies and speedups span decades across shapes and backends.
        axes.set_yscale("log")
        axes.set_xlabel(
            "position of the step in the KV cache" if dim == POSITION else f"live size of {dim}"
        )
        axes.set_ylabel(series)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(title)
    with atomic_path(path, "the plot") as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return path
