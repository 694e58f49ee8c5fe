"""The comparison table, one row per job: as text for the log, CSV, and a self-contained page."""

from __future__ import annotations

import base64
import csv
import html
import io
from collections.abc import Sequence
from pathlib import Path

from tabulate import tabulate

from exporter.files import write_bytes
from exporter.tracking.comparison.summary import JobSummary

CSV_FILE = "comparison.csv"
HTML_FILE = "comparison.html"

COLUMNS = (
    "status",
    "failed_stage",
    "failed_on",
    "worst_max_abs_err",
    "worst_nrmse",
    "worst_error_ratio",
    "weights_mismatched",
    "diverged_at",
    "quality_kld_mean",
    "quality_kld_p99",
    "quality_top1",
    "quality_prob_drop",
    "quality_ppl_ratio",
    "latency_at_min_ms",
    "latency_at_max_ms",
    "worst_speedup_vs_eager",
    "speedup_range",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
    "artifact_bytes",
    "delegated_fraction",
    "startup_s",
    "export_s",
    "lower_s",
    "validate_s",
    "localize_s",
    "benchmark_s",
    "total_s",
    "cache_hit",
    "error",
)
_STAGES = ("startup", "export", "lower", "validate", "localize", "benchmark")
# A terminal's table: after the job, its choices and its status, the columns that tell jobs
# apart at a glance, under short names, most telling first (the last ones go where a terminal is
# too narrow); comparison.csv and comparison.html have every column.
TERMINAL_WIDTH = 120
TERMINAL_COLUMNS = (
    ("stage", "failed_stage"),
    ("ratio", "worst_error_ratio"),
    ("KLD", "quality_kld_mean"),
    ("speedup", "speedup_range"),
    ("s", "total_s"),
    ("max_abs", "worst_max_abs_err"),
    ("ms@max", "latency_at_max_ms"),
    ("MB", "artifact_bytes"),
    ("delegated", "delegated_fraction"),
    ("cache", "cache_hit"),
)
# The terminal's columns of a quantized model's figures, shown where a job has them.
_QUALITY_COLUMNS = ("quality_kld_mean",)
# The characters of a failed job's error that a terminal's table keeps at least.
_ERROR_WIDTH = 36


def distinguishing_groups(summaries: Sequence[JobSummary]) -> list[str]:
    """The config groups whose choices differ between the jobs (model and backend if none do),
    model and backend first."""
    groups = list(dict.fromkeys(group for s in summaries for group in s.choices))
    groups.sort(key=lambda group: group not in ("model", "backend"))
    columns: dict[tuple, str] = {}
    for group in groups:
        values = tuple(s.choices.get(group) for s in summaries)
        # A group that follows another (dynamic follows model) would repeat its column.
        if len(set(values)) > 1 and values not in columns:
            columns[values] = group
    return list(columns.values()) or [g for g in ("model", "backend") if g in groups]


def labels(summaries: Sequence[JobSummary]) -> list[str]:
    """Each job by its distinguishing choices: `backend=eager fallback=strict`."""
    groups = distinguishing_groups(summaries)
    return [" ".join(f"{g}={s.choices.get(g, '-')}" for g in groups) for s in summaries]


def rows(summaries: Sequence[JobSummary]) -> tuple[list[str], list[list[object]]]:
    """The headers (job, the distinguishing groups, then COLUMNS) and one row per job."""
    choice_columns = distinguishing_groups(summaries)
    table = []
    for summary in summaries:
        values = {
            **{f"{stage}_s": summary.seconds.get(stage) for stage in _STAGES},
            "cache_hit": ",".join(k for k, hit in summary.cache_hits.items() if hit) or None,
            "speedup_range": _range(summary.speedup_range()),
            # Whole: its later lines are the detail (the ops that stayed outside, ...).
            "error": summary.error or None,
        }
        table.append(
            [summary.job]
            + [summary.choices.get(group) for group in choice_columns]
            + [values[c] if c in values else getattr(summary, c) for c in COLUMNS]
        )
    return ["job", *choice_columns, *COLUMNS], table


def text(summaries: Sequence[JobSummary], width: int = TERMINAL_WIDTH) -> str:
    """The table for a terminal, at most `width` characters wide: the job, its distinguishing
    choices, its status, the columns of TERMINAL_COLUMNS under short names and the error's
    first line, clipped; columns are dropped from the end of TERMINAL_COLUMNS until it fits."""
    headers, table = rows(summaries)
    index = {header: n for n, header in enumerate(headers)}
    leading = ["job", *distinguishing_groups(summaries), "status"]
    errors = [_first_line(row[index["error"]]) for row in table]
    # The reason a job failed says more than its figures: they make room for it.
    reserved = _ERROR_WIDTH + 2 if any(errors) else 0
    # A sweep of float models has no quality to show: its column would only take room.
    quantized = any(summary.quality_kld_mean is not None for summary in summaries)
    columns = [c for c in TERMINAL_COLUMNS if quantized or c[1] not in _QUALITY_COLUMNS]
    while True:
        shown = leading + [name for name, _ in columns]
        cells = [
            [_format(row[index[h]]) for h in leading]
            + [_terminal_format(row[index[column]], column) for _, column in columns]
            for row in table
        ]
        plain = tabulate(cells, headers=shown, disable_numparse=True)
        if _width(plain) + reserved <= width or not columns:
            break
        columns.pop()
    if not any(errors):
        return plain
    room = max(width - _width(plain) - 2, len("error"))
    return tabulate(
        [[*row, _clip(error, room)] for row, error in zip(cells, errors, strict=True)],
        headers=[*shown, "error"],
        disable_numparse=True,
    )


def _range(span: tuple[float, float] | None) -> str | None:
    return f"{span[0]:.3g}..{span[1]:.3g}x" if span else None


def _terminal_format(value: object, column: str) -> str:
    if column == "artifact_bytes" and isinstance(value, int):
        return f"{value / 1e6:.3g}"
    if column == "total_s" and isinstance(value, float):
        return f"{value:.0f}"
    return _format(value)


def _first_line(error: object) -> str:
    return str(error).split("\n", 1)[0] if error else ""


def _clip(line: str, room: int) -> str:
    return line if len(line) <= room else line[: room - 1] + "…"


def _width(table: str) -> int:
    return max(map(len, table.splitlines()), default=0)


def write_csv(summaries: Sequence[JobSummary], folder: Path) -> Path:
    headers, table = rows(summaries)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(headers)
    writer.writerows([["" if value is None else value for value in row] for row in table])
    return write_bytes(folder / CSV_FILE, buffer.getvalue().encode())


def write_html(
    summaries: Sequence[JobSummary], plots: Sequence[Path], title: str, folder: Path
) -> Path:
    """One file with everything inlined (styles, plots), so it opens anywhere it is copied."""
    headers, table = rows(summaries)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        f'<tr class="{html.escape(summary.status.replace(" ", "-"))}">'
        + "".join(f"<td>{html.escape(_format(value))}</td>" for value in row)
        + "</tr>"
        for summary, row in zip(summaries, table, strict=True)
    )
    images = "".join(
        f'<img alt="{html.escape(plot.stem)}" '
        f'src="data:image/png;base64,{base64.b64encode(plot.read_bytes()).decode()}">'
        for plot in plots
    )
    failed = sum(summary.status != "passed" for summary in summaries)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: left; max-width: 36em; }}
td {{ white-space: pre-wrap; overflow-wrap: anywhere; vertical-align: top; }}
tr.passed td {{ background: #eef8ee; }}
tr.failed td, tr.killed td, tr.no-result td {{ background: #fbe9e9; }}
img {{ max-width: 48%; margin: 1em 1% 0 0; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{len(summaries)} jobs, {len(summaries) - failed} passed, {failed} did not.</p>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{images}
</body></html>
"""
    return write_bytes(folder / HTML_FILE, page.encode())


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
