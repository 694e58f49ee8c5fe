"""The comparison's plots: worst error and latency against live size, one line per job."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from exporter.comparison.summary import JobSummary
from exporter.files import atomic_path

ERROR_PLOT = "max_abs_err_vs_size.png"
LATENCY_PLOT = "latency_vs_size.png"


def write_plots(summaries: Sequence[JobSummary], labels: Sequence[str], folder: Path) -> list[Path]:
    """Both plots of the jobs that got as far as validation; none if no job did."""
    measured = [(s, label) for s, label in zip(summaries, labels, strict=True) if s.sizes]
    if not measured:
        return []
    return [
        _plot(measured, "max_abs_err", "max abs error vs eager float64", True, folder / ERROR_PLOT),
        _plot(measured, "latency_ms", "latency (ms, fastest run)", False, folder / LATENCY_PLOT),
    ]


def _plot(
    measured: Sequence[tuple[JobSummary, str]],
    series: str,
    title: str,
    log_scale: bool,
    path: Path,
) -> Path:
    # A bare Figure, not pyplot: no global state and no display, so jobs can plot in parallel.
    # Imported here: a job that ends before validation draws nothing and need not load it.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.add_subplot()
    for summary, label in measured:
        axes.plot(summary.sizes, getattr(summary, series), marker="o", label=label)
    if log_scale:
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
