"""Sweeps as a user runs them (`python -m exporter -m ...`): every job runs, each gets a run
nested under the sweep's parent, and the comparison reports all of them, failed ones marked;
the README's link opens the sweep in MLflow's UI (an MLflow server over the store the sweep
filled, in headless Chromium), on its runs with the columns that say how each job ended, every
job's run named by what the sweep varied, and a job's per-shape metric plotted against the live
size."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from exporter.tracking import runs as tracking
from tests.conftest import PROJECT_ROOT, SweepResult, run_sweep
from tests.drawn_plots import job_colours
from tests.mlflow_ui import CHROMIUM, STATUS, browse_sweep, serve_mlflow, shown_as_logged

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Kept after the test, for a person to look at: outputs/ is the project's, and git-ignored.
SCREENSHOTS = PROJECT_ROOT / "outputs" / "e2e" / "mlflow-ui-sweep"
# The per-shape metric whose chart a user looks for to compare backends.
PER_SHAPE_METRIC = "speedup_vs_eager"


def comparison_rows(sweep: SweepResult) -> list[dict[str, str]]:
    with (sweep.sweep_dir / "comparison.csv").open() as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory: pytest.TempPathFactory) -> SweepResult:
    """2x2 on mlp: the two jobs with min 65 > max 64 are impossible and fail at config."""
    workdir = tmp_path_factory.mktemp("sweep")
    return run_sweep(
        workdir,
        workdir / "sweep",
        "model=mlp",
        "backend=eager,executorch",
        "dynamic.batch.min=1,65",
    )


def test_a_sweep_runs_every_job_and_exits_with_the_failed_jobs_code(
    failing_sweep: SweepResult,
) -> None:
    assert failing_sweep.exit_code == 2, failing_sweep.output
    assert "Traceback" not in failing_sweep.output
    job_dirs = sorted(p.name for p in failing_sweep.sweep_dir.iterdir() if p.is_dir())
    assert job_dirs == ["0-mlp-eager", "1-mlp-eager", "2-mlp-executorch", "3-mlp-executorch"]
    assert (failing_sweep.sweep_dir / "2-mlp-executorch" / "model.pte").stat().st_size > 0


def test_each_job_gets_a_run_nested_under_the_sweeps_parent(failing_sweep: SweepResult) -> None:
    parent, children = failing_sweep.parent_and_children()
    assert len(failing_sweep.runs()) == 5
    assert parent.info.status == "FAILED"
    assert parent.data.tags["sweep.overrides"].endswith(
        " model=mlp backend=eager,executorch dynamic.batch.min=1,65"
    )
    # Named by what the sweep varies: the parent by its swept overrides, each job by its values.
    assert parent.info.run_name == "sweep backend=eager,executorch dynamic.batch.min=1,65"
    assert [run.info.run_name for run in children] == [
        "backend=eager dynamic.batch.min=1",
        "backend=eager dynamic.batch.min=65",
        "backend=executorch dynamic.batch.min=1",
        "backend=executorch dynamic.batch.min=65",
    ]
    by_job = {run.data.tags["job"]: run for run in children}
    assert list(by_job) == ["0-mlp-eager", "1-mlp-eager", "2-mlp-executorch", "3-mlp-executorch"]
    for job in ("1-mlp-eager", "3-mlp-executorch"):
        failed = by_job[job]
        assert failed.info.status == "FAILED"
        assert failed.data.tags["failed_stage"] == "config"
        assert "min (65) is greater than max (64)" in failed.data.tags["error"]
        assert failed.data.tags["mlflow.note.content"].startswith(
            "failed (exit 2) at the config stage: "
        )
    for job in ("0-mlp-eager", "2-mlp-executorch"):
        assert by_job[job].info.status == "FINISHED"
        assert by_job[job].data.metrics["worst_max_abs_err"] < 1e-6
        assert (
            by_job[job]
            .data.tags["mlflow.note.content"]
            .startswith("passed (exit 0) at all 7 live shapes")
        )
    # The parent's figures are its jobs' worst, in the columns where each job shows its own.
    assert parent.data.metrics == {
        "jobs": 4,
        "jobs_passed": 2,
        "jobs_failed": 2,
        "worst_speedup_vs_eager": min(
            by_job[job].data.metrics["worst_speedup_vs_eager"]
            for job in ("0-mlp-eager", "2-mlp-executorch")
        ),
        "worst_error_ratio": max(
            by_job[job].data.metrics["worst_error_ratio"]
            for job in ("0-mlp-eager", "2-mlp-executorch")
        ),
    }
    description = parent.data.tags["mlflow.note.content"].splitlines()
    assert description[2].startswith(
        "- backend=eager dynamic.batch.min=1: passed (exit 0) at all 7 live shapes"
    )
    assert description[3].startswith(
        "- backend=eager dynamic.batch.min=65: failed (exit 2) at the config"
    )
    # Job 2 needs the same exported program and goldens as job 0: it reuses them.
    assert by_job["0-mlp-eager"].data.tags["cache_hit"] == "false"
    assert by_job["2-mlp-executorch"].data.tags["cache_hit.export"] == "true"
    assert by_job["2-mlp-executorch"].data.tags["cache_hit.goldens"] == "true"
    assert by_job["2-mlp-executorch"].data.tags["cache_hit.lower"] == "false"


def test_the_comparison_table_marks_the_failed_rows(failing_sweep: SweepResult) -> None:
    rows = comparison_rows(failing_sweep)
    assert [(r["backend"], r["status"], r["failed_stage"]) for r in rows] == [
        ("eager", "passed", ""),
        ("eager", "failed", "config"),
        ("executorch", "passed", ""),
        ("executorch", "failed", "config"),
    ]
    passed = rows[2]
    assert 0 < float(passed["worst_max_abs_err"]) < 1e-6
    assert float(passed["latency_at_min_ms"]) > 0 and float(passed["latency_at_max_ms"]) > 0
    assert float(passed["worst_speedup_vs_eager"]) > 0
    assert float(passed["delegated_fraction"]) == 1.0
    assert (
        int(passed["artifact_bytes"])
        == (failing_sweep.sweep_dir / "2-mlp-executorch" / "model.pte").stat().st_size
    )
    assert "greater than max" in rows[1]["error"]

    page = (failing_sweep.sweep_dir / "comparison.html").read_text()
    assert page.count('<tr class="failed">') == 2
    assert page.count('<tr class="passed">') == 2
    # Error, latency and speedup against size.
    assert page.count("data:image/png;base64,") == 3
    assert "worst_speedup_vs_eager" in page


def test_the_sweep_ends_with_its_table_of_jobs_and_the_comparisons_path(
    failing_sweep: SweepResult,
) -> None:
    # Its 4 jobs' rows under a header and a rule, after a line that counts them.
    said, header, rule, *rows, where = failing_sweep.output.rstrip().splitlines()[-8:]
    assert said.endswith("[sweep] 4 jobs, 2 passed, 2 did not:")
    assert where.endswith(f"[sweep] comparison: {failing_sweep.sweep_dir / 'comparison.html'}")
    assert max(len(line) for line in (header, rule, *rows)) <= 120
    assert header.split()[:7] == ["job", "backend", "status", "stage", "ratio", "speedup", "s"]
    assert len(rows) == 4 and set(rule) == {"-", " "}
    executorch = json.loads(
        (failing_sweep.sweep_dir / "2-mlp-executorch" / "summary.json").read_text()
    )
    speedups = executorch["speedup_vs_eager"]
    assert rows[2].split()[:6] == [
        "2-mlp-executorch",
        "executorch",
        "passed",
        f"{executorch['worst_error_ratio']:.3g}",
        f"{min(speedups):.3g}..{max(speedups):.3g}x",
        f"{executorch['total_s']:.0f}",
    ]
    assert rows[3].split()[:4] == ["3-mlp-executorch", "executorch", "failed", "config"]


def test_the_plots_and_report_are_on_the_parent_run(failing_sweep: SweepResult) -> None:
    plots = ("max_abs_err_vs_size.png", "latency_vs_size.png", "speedup_vs_eager_vs_size.png")
    for plot in plots:
        assert (failing_sweep.sweep_dir / plot).read_bytes().startswith(PNG_MAGIC)
        # The lines of the two jobs that ran (0-mlp-eager in C0, 2-mlp-executorch in C1); the
        # two the config refused have no figures to draw.
        assert job_colours(failing_sweep.sweep_dir / plot) == [0, 1], plot
    parent, children = failing_sweep.parent_and_children()
    client = MlflowClient(failing_sweep.tracking_uri)
    logged = {artifact.path for artifact in client.list_artifacts(parent.info.run_id)}
    assert logged >= {
        "comparison.csv",
        "comparison.html",
        *plots,
    }
    # Each job that passed has its speedup over eager at every live size, as steps.
    passed = [run for run in children if run.data.tags["status"] == "passed"]
    assert len(passed) == 2
    for run in passed:
        history = client.get_metric_history(run.info.run_id, "speedup_vs_eager")
        assert sorted(m.step for m in history) == [1, 2, 33, 50, 54, 63, 64]
        assert all(m.value > 0 for m in history)


# About 85 s each: parallel jobs on 2 cores, each exporting and lowering.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "jobs"),
    [
        (["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "fallback=auto,strict"], 4),
        # submitit starts every job at once: two are enough to share the store.
        (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], 2),
    ],
    ids=["joblib", "submitit_local"],
)
def test_parallel_launchers_lose_no_run_and_a_second_pass_hits_the_cache(
    tmp_path: Path, launcher: list[str], jobs: int
) -> None:
    overrides = ["model=mlp", "backend=eager,executorch", *launcher]
    sweeps = [run_sweep(tmp_path, tmp_path / f"pass{n}", *overrides) for n in (1, 2)]
    for sweep in sweeps:
        assert sweep.exit_code == 0, sweep.output
        assert "database is locked" not in sweep.output
        parent, children = sweep.parent_and_children()
        assert parent.info.status == "FINISHED"
        assert [run.info.status for run in children] == ["FINISHED"] * jobs
    assert len(sweeps[1].runs()) == 2 * (jobs + 1)
    _, second = sweeps[1].parent_and_children()
    assert [run.data.tags["cache_hit"] for run in second] == ["true"] * jobs
    executorch = [run for run in second if run.data.tags["backend"] == "executorch"]
    assert [run.data.tags["cache_hit.lower"] for run in executorch] == ["true"] * (jobs // 2)


@pytest.mark.browser
def test_the_readmes_link_opens_a_sweep_on_its_runs_with_each_jobs_verdict_and_speedup(
    failing_sweep: SweepResult, tmp_path: Path
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium), "
            "or deselect this test with -m 'not browser'."
        )
    sweep = failing_sweep
    parent, children = sweep.parent_and_children()
    names = [run.info.run_name for run in children]
    assert names == [
        "backend=eager dynamic.batch.min=1",
        "backend=eager dynamic.batch.min=65",
        "backend=executorch dynamic.batch.min=1",
        "backend=executorch dynamic.batch.min=65",
    ]
    lowered = children[2]
    client = MlflowClient(sweep.tracking_uri)
    report = client.download_artifacts(lowered.info.run_id, "report.json", str(tmp_path))
    live_sizes = [
        entry["shape"]["batch"] for entry in json.loads(Path(report).read_text())["shapes"]
    ]
    history = client.get_metric_history(lowered.info.run_id, PER_SHAPE_METRIC)
    logged = sorted((metric.step, metric.value) for metric in history)
    assert [step for step, _ in logged] == live_sizes
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == tracking.MODEL_DEVELOPMENT

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with serve_mlflow(sweep.tracking_uri, tmp_path) as base_url:
        shown = browse_sweep(
            tracking.runs_view_url(base_url, parent.info.experiment_id),
            names,
            lowered.info.run_name,
            PER_SHAPE_METRIC,
            SCREENSHOTS,
        )

    assert shown.opened_on == "Runs"
    # As it opens: the sweep, closed, with its jobs' worst figures in its own columns.
    assert list(shown.opened) == [parent.info.run_name]
    shown_as_logged(shown.opened[parent.info.run_name], parent)
    assert shown.opened[parent.info.run_name][STATUS] == "failed"
    # Opened: every job by what it varies, with its verdict and worst speedup.
    assert list(shown.expanded) == [parent.info.run_name, *reversed(names)]
    for run in children:
        shown_as_logged(shown.expanded[run.info.run_name], run)
    assert [shown.expanded[name][STATUS] for name in names] == [
        "passed",
        "failed",
        "passed",
        "failed",
    ]
    # The values travel as JSON from the store to the chart, so they arrive exactly.
    assert shown.chart_points == logged
    for screenshot in ("opened.png", "experiment.png", "chart.png"):
        assert (SCREENSHOTS / screenshot).stat().st_size > 20_000
