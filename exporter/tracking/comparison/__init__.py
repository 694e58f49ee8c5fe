"""Jobs side by side: a table (text, CSV, HTML) and plots of error and latency per live size."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from exporter.tracking.comparison.plots import write_plots
from exporter.tracking.comparison.summary import SUMMARY_FILE, JobSummary, collect, group_choices
from exporter.tracking.comparison.table import HTML_FILE, labels, text, write_csv, write_html

__all__ = [
    "HTML_FILE",
    "SUMMARY_FILE",
    "JobSummary",
    "collect",
    "group_choices",
    "text",
    "write",
    "write_plots",
]


def write(summaries: Sequence[JobSummary], title: str, folder: Path) -> list[Path]:
    """comparison.csv, comparison.html and the plots, in `folder`; returns their paths."""
    plots = write_plots(summaries, labels(summaries), folder)
    return [write_csv(summaries, folder), write_html(summaries, plots, title, folder), *plots]
