"""The comparison's plots against live size, one line per job: worst error, the benchmark's
latency (median, with bars from its 10th to its 90th percentile) and its speedup over eager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from exporter.comparison.summary import JobSummary
from exporter.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes

ERROR_PLOT = "max_abs_err_vs_size.png"
LATENCY_PLOT = "latency_vs_size.png"
SPEEDUP_PLOT = "speedup_vs_eager_vs_size.png"


def write_plots(summaries: Sequence[JobSummary], labels: Sequence[str], folder: Path) -> list[Path]:
    """The error plot of the jobs that got as far as validation, and the latency and speedup
    plots of those the benchmark timed; none where no job got that far."""
    validated = [(s, label) for s, label in zip(summaries, labels, strict=True) if s.sizes]
    timed = [(s, label) for s, label in validated if s.latency_ms]
    compared = [(s, label) for s, label in timed if any(x is not None for x in s.speedup_vs_eager)]
    plots = (
        (validated, ERROR_PLOT, "max abs error vs eager float64", "max_abs_err", _errors),
        (timed, LATENCY_PLOT, "latency (ms): median, bars p10 to p90", "latency_ms", _latency),
        (
            compared,
            SPEEDUP_PLOT,
            "speedup vs eager (eager's median over the artifact's)",
            "speedup_vs_eager",
            _speedup,
        ),
    )
    return [
        _plot(jobs, title, series, draw, folder / name)
        for jobs, name, title, series, draw in plots
        if jobs
    ]


def _errors(axes: Axes, summary: JobSummary, label: str) -> None:
    axes.plot(summary.sizes, summary.max_abs_err, marker="o", label=label)


def _latency(axes: Axes, summary: JobSummary, label: str) -> None:
    below = [m - p10 for m, p10 in zip(summary.latency_ms, summary.latency_p10_ms, strict=True)]
    above = [p90 - m for m, p90 in zip(summary.latency_ms, summary.latency_p90_ms, strict=True)]
    axes.errorbar(
        summary.sizes, summary.latency_ms, yerr=[below, above], marker="o", capsize=3, label=label
    )


def _speedup(axes: Axes, summary: JobSummary, label: str) -> None:
    points = [(x, y) for x, y in zip(summary.sizes, summary.speedup_vs_eager, strict=True) if y]
    axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=1)


def _plot(
    measured: Sequence[tuple[JobSummary, str]],
    title: str,
    series: str,
    draw: Callable[[Axes, JobSummary, str], None],
    path: Path,
) -> Path:
    # A bare Figure, not pyplot: no global state and no display, so jobs can plot in parallel.
    # Imported here: a job that ends before validation draws nothing and need not load it.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    for summary, label in measured:
        draw(axes, summary, label)
    # Errors, latencies and speedups span decades across shapes and backends.
    axes.set_yscale("log")
    dims = sorted({summary.dim for summary, _ in measured if summary.dim})
    axes.set_xlabel(f"live size ({', '.join(dims)})")
    axes.set_ylabel(series)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return path
