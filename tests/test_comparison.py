"""The comparison of a sweep's jobs, read back from their folders as the sweep leaves them."""

from __future__ import annotations

import csv
from dataclasses import fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from exporter.tracking import comparison
from exporter.tracking.comparison import JobSummary
from exporter.tracking.comparison.table import labels
from tests.drawn_plots import Panel, job_colours, panels, saved_figures


def job_dir(sweep_dir: Path, name: str, backend: str) -> Path:
    """A job folder as Hydra makes it before the job runs."""
    folder = sweep_dir / name
    (folder / ".hydra").mkdir(parents=True)
    choices = {"model": "mlp", "dynamic": "mlp", "backend": backend, "hydra/launcher": "basic"}
    OmegaConf.save({"hydra": {"runtime": {"choices": choices}}}, folder / ".hydra" / "hydra.yaml")
    return folder


def passed(name: str, backend: str) -> JobSummary:
    return JobSummary(
        job=name,
        choices={"model": "mlp", "dynamic": "mlp", "backend": backend},
        status="passed",
        exit_code=0,
        worst_max_abs_err=8.5e-8,
        shapes=[{"batch": 1}, {"batch": 2}, {"batch": 64}],
        max_abs_err=[3e-8, 4e-8, 8.5e-8],
        latency_ms=[0.05, 0.05, 0.07],
        latency_p10_ms=[0.04, 0.05, 0.06],
        latency_p90_ms=[0.06, 0.07, 0.09],
        eager_latency_ms=[0.1, 0.1, 0.07],
        speedup_vs_eager=[2.0, 2.0, 1.0],
        worst_speedup_vs_eager=1.0,
    )


def test_a_job_that_left_no_summary_is_a_row_with_no_result(tmp_path: Path) -> None:
    passed("0-mlp-eager", "eager").write(job_dir(tmp_path, "0-mlp-eager", "eager"))
    job_dir(tmp_path, "1-mlp-executorch", "executorch")
    summaries = comparison.collect(tmp_path)
    assert [(s.job, s.status, s.exit_code) for s in summaries] == [
        ("0-mlp-eager", "passed", 0),
        ("1-mlp-executorch", "no result", None),
    ]
    assert summaries[1].choices == {"model": "mlp", "dynamic": "mlp", "backend": "executorch"}


def test_jobs_are_labelled_by_the_choices_that_differ(tmp_path: Path) -> None:
    summaries = [passed("0-mlp-eager", "eager"), passed("1-mlp-executorch", "executorch")]
    assert labels(summaries) == ["backend=eager", "backend=executorch"]
    # One job alone, or jobs that differ in nothing chosen, show model and backend.
    assert labels(summaries[:1]) == ["model=mlp backend=eager"]


def test_jobs_are_listed_by_their_number_not_their_name(tmp_path: Path) -> None:
    names = ["10-mlp-eager", "2-mlp-eager", "1-mlp-eager"]
    for name in names:
        passed(name, "eager").write(job_dir(tmp_path, name, "eager"))
    assert [s.job for s in comparison.collect(tmp_path)] == names[::-1]


def test_each_dynamic_dim_gets_a_panel_with_the_jobs_that_have_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoder = passed("1-encoder-executorch", "executorch")
    encoder.choices["model"] = "encoder"
    encoder.shapes = [{"batch": 1, "seq": 1}, {"batch": 1, "seq": 64}, {"batch": 8, "seq": 1}]
    # Errors of its own, so that a point placed by another shape's size shows.
    encoder.max_abs_err = [2e-7, 1e-7, 3e-7]
    figures = saved_figures(monkeypatch)
    plots = comparison.write_plots([passed("0-mlp-eager", "eager"), encoder], ["a", "b"], tmp_path)
    assert [plot.name for plot in plots] == [
        "max_abs_err_vs_size.png",
        "latency_vs_size.png",
        "speedup_vs_eager_vs_size.png",
    ]
    # Two panels side by side, each 7 inches at 110 dpi, and both jobs' lines drawn.
    for plot in plots:
        assert Image.open(plot).size == (1540, 495)
        assert job_colours(plot) == [0, 1]
    # Each point a live shape placed by that dim's size: batch has both jobs, seq the encoder.
    error, latency, speedup = (panels(figure) for figure in figures)
    assert error == [
        Panel(
            "live size of batch",
            {"a": [(1, 3e-8), (2, 4e-8), (64, 8.5e-8)], "b": [(1, 1e-7), (1, 2e-7), (8, 3e-7)]},
        ),
        Panel("live size of seq", {"b": [(1, 2e-7), (1, 3e-7), (64, 1e-7)]}),
    ]
    assert latency == [
        Panel(
            "live size of batch",
            {"a": [(1, 0.05), (2, 0.05), (64, 0.07)], "b": [(1, 0.05), (1, 0.05), (8, 0.07)]},
        ),
        Panel("live size of seq", {"b": [(1, 0.05), (1, 0.07), (64, 0.05)]}),
    ]
    assert speedup == [
        Panel(
            "live size of batch",
            {"a": [(1, 2.0), (2, 2.0), (64, 1.0)], "b": [(1, 2.0), (1, 2.0), (8, 1.0)]},
        ),
        Panel("live size of seq", {"b": [(1, 1.0), (1, 2.0), (64, 2.0)]}),
    ]


def test_the_files_hold_one_row_per_job_and_a_plot_of_each_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = JobSummary(
        job="1-mlp-executorch",
        choices={"model": "mlp", "backend": "executorch"},
        status="failed",
        exit_code=4,
        failed_stage="lower",
        error="fallback=strict: 2 compute nodes would run outside\n  aten.nonzero x2",
    )
    summaries = [passed("0-mlp-eager", "eager"), failed]
    figures = saved_figures(monkeypatch)
    files = comparison.write(summaries, "Sweep test", tmp_path)
    assert [path.name for path in files] == [
        "comparison.csv",
        "comparison.html",
        "max_abs_err_vs_size.png",
        "latency_vs_size.png",
        "speedup_vs_eager_vs_size.png",
    ]
    # The failed job has no figures: each plot draws the passed job's line alone.
    passed_label = labels(summaries)[0]
    for figure, plot in zip(figures, files[2:], strict=True):
        assert [list(panel.lines) for panel in panels(figure)] == [[passed_label]]
        assert job_colours(plot) == [0]
    with (tmp_path / "comparison.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(r["job"], r["backend"], r["status"], r["failed_stage"]) for r in rows] == [
        ("0-mlp-eager", "eager", "passed", ""),
        ("1-mlp-executorch", "executorch", "failed", "lower"),
    ]
    assert rows[1]["error"] == failed.error
    assert float(rows[0]["worst_max_abs_err"]) == 8.5e-8
    assert float(rows[0]["worst_speedup_vs_eager"]) == 1.0
    assert rows[1]["worst_speedup_vs_eager"] == ""


def test_a_failed_validation_row_says_where_it_diverged_and_how_many_weights_differ(
    tmp_path: Path,
) -> None:
    diverged = JobSummary(
        job="1-llama-executorch",
        choices={"model": "llama", "backend": "executorch"},
        status="failed",
        exit_code=1,
        failed_stage="validate",
        diverged_at="rsqrt_3 (aten.rsqrt.default)",
        weights_checked=23,
        weights_mismatched=0,
        weights_unseen=0,
        seconds={"lower": 7.4, "validate": 0.4, "localize": 26.1},
    )
    tampered = JobSummary(
        job="2-llama-executorch",
        choices={"model": "llama", "backend": "executorch"},
        status="failed",
        exit_code=1,
        failed_stage="validate",
        diverged_at="not reproduced",
        weights_mismatched=1,
    )
    comparison.write([passed("0-mlp-eager", "eager"), diverged, tampered], "Sweep", tmp_path)
    with (tmp_path / "comparison.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [(r["diverged_at"], r["weights_mismatched"], r["localize_s"]) for r in rows] == [
        ("", "", ""),
        ("rsqrt_3 (aten.rsqrt.default)", "0", "26.1"),
        ("not reproduced", "1", ""),
    ]


def strict_sweep() -> list[JobSummary]:
    """`-m fallback=auto,strict` on a model with an op XNNPACK does not take: every column
    filled as a real sweep fills it."""
    reason = (
        "fallback=strict: 2 compute nodes would run outside the XNNPACK delegate:\n"
        "  aten.nonzero.default x1: data-dependent output shape\n"
        "  aten.index.Tensor x1: no XNNPACK kernel for boolean indexing\n"
        "Use fallback=auto (or data_dependent) to let them run outside it."
    )
    auto = JobSummary(
        job="0-masked-executorch",
        choices={"model": "masked", "backend": "executorch", "fallback": "auto"},
        status="passed",
        exit_code=0,
        worst_max_abs_err=1.1920928955078125e-07,
        worst_nrmse=3.0517578125e-08,
        worst_error_ratio=1.5,
        worst_error_ratio_at="batch=1",
        weights_mismatched=0,
        diverged_at="linear_3 (aten.linear.default)",
        latency_at_min_ms=0.0421,
        latency_at_max_ms=0.3119,
        worst_speedup_vs_eager=0.8731,
        artifact_bytes=123456789,
        delegated_fraction=0.8571,
        seconds={"export": 1.234, "lower": 12.345, "validate": 1.5, "benchmark": 3.25},
        total_s=21.4,
        cache_hits={"export": True, "goldens": True, "lower": False},
        speedup_vs_eager=[0.8731, 2.25],
    )
    strict = JobSummary(
        job="1-masked-executorch",
        choices={"model": "masked", "backend": "executorch", "fallback": "strict"},
        status="failed",
        exit_code=4,
        failed_stage="lower",
        error=reason,
        seconds={"export": 1.2, "lower": 11.9},
        total_s=16.0,
        cache_hits={"export": True},
    )
    return [auto, strict]


def test_the_error_cell_keeps_the_whole_reason_in_the_csv_and_the_page(tmp_path: Path) -> None:
    summaries = strict_sweep()
    comparison.write(summaries, "Sweep", tmp_path)
    with (tmp_path / "comparison.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert rows[1]["error"] == summaries[1].error
    page = (tmp_path / "comparison.html").read_text()
    assert "aten.index.Tensor x1: no XNNPACK kernel for boolean indexing" in page
    assert "white-space: pre-wrap" in page


def test_the_terminal_table_fits_120_columns_and_names_the_reason(tmp_path: Path) -> None:
    table = comparison.text(strict_sweep())
    lines = table.splitlines()
    assert max(map(len, lines)) <= 120, table
    header, _, passed_row, failed_row = lines
    assert header.split()[:7] == ["job", "fallback", "status", "stage", "ratio", "speedup", "s"]
    assert "fallback=strict: 2 compute nodes" in failed_row
    assert failed_row.rstrip().endswith("…")
    assert passed_row.split()[3:6] == ["1.5", "0.873..2.25x", "21"]
    assert failed_row.split()[3:5] == ["lower", "16"]


def test_a_narrow_terminal_drops_the_least_telling_columns_first() -> None:
    table = comparison.text(strict_sweep(), width=80)
    assert max(map(len, table.splitlines())) <= 80, table
    assert table.splitlines()[0].split() == ["job", "fallback", "status", "error"]


def test_the_verdict_line_says_how_the_job_ended_and_its_figures() -> None:
    job = passed("0-mlp-executorch", "executorch")
    # Eager's own error not measured: no ratio, the speedup range only.
    assert job.verdict() == ("passed (exit 0) at all 3 live shapes: speedup over eager 1x..2x")
    job.worst_error_ratio, job.worst_error_ratio_at = 2.64453, "batch=64"
    job.speedup_vs_eager = [5.8496, 9.6812, None]
    assert job.verdict() == (
        "passed (exit 0) at all 3 live shapes: worst error ratio 2.64 at batch=64 (artifact's "
        "error / eager's); speedup over eager 5.85x..9.68x"
    )
    # A passed job whose MLflow run could not be written: the command's exit code.
    assert job.outcome(7) == "passed (exit 7) at all 3 live shapes; its MLflow run was not written"
    # A failure's first line only: the rest is the run's error and description.
    assert strict_sweep()[1].verdict() == (
        "failed (exit 4) at the lower stage: fallback=strict: 2 compute nodes would run outside "
        "the XNNPACK delegate:"
    )
    job.status, job.exit_code, job.failed_stage = "failed", 1, "validate"
    job.failed_shapes = ["batch=1", "batch=64"]
    assert job.outcome() == (
        "failed (exit 1) at the validate stage: 2 of 3 live shapes failed: batch=1, batch=64"
    )
    killed = JobSummary("0-mlp-eager", {}, "killed", 143, "validate", "stopped by SIGTERM")
    assert killed.verdict() == "killed (exit 143) during the validate stage: stopped by SIGTERM"
    killed.error = None
    assert killed.outcome() == "killed (exit 143) during the validate stage: stopped by SIGTERM"
    lost = JobSummary("0-mlp-eager", {}, "no result", None)
    assert lost.verdict().startswith("no result: ")


def test_a_figure_declared_with_its_mlflow_name_is_logged_under_it_where_measured() -> None:
    summary = JobSummary(
        job="0-mlp-eager",
        choices={"backend": "eager"},
        status="failed",
        exit_code=1,
        failed_stage="validate",
        weight_bytes=2_500_000_000,
        weights_mismatched=0,
        export_failures=["data_dependent", "guard"],
        draft=True,
        cache_hits={"export": True, "lower": False},
        target={"cpu": "AMD EPYC"},
    )
    # Zero is a measurement; None, an empty list and False are not.
    assert summary.metrics() == {"weight_gb": 2.5, "weights_mismatched": 0}
    assert summary.tags() == {
        "failed_stage": "validate",
        "export.failure_kinds": "data_dependent,guard",
        "export.draft": "true",
        "cache_hit.export": "true",
        "cache_hit.lower": "false",
        "target.cpu": "AMD EPYC",
    }


def test_no_two_figures_of_a_summary_share_an_mlflow_name() -> None:
    names = [
        f.metadata.get("metric") or f.metadata.get("tag") for f in fields(JobSummary) if f.metadata
    ]
    assert len(names) == len(set(names)) >= 20
