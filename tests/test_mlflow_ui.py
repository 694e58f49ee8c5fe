"""The MLflow UI shows a real sweep: an MLflow server over the store the sweep filled, its
experiment opened in headless Chromium as the README's link opens it, on its runs with the
columns that say how each job ended, every job's run named by what the sweep varied, and a job's
per-shape metric plotted against the live size."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from exporter.config import MlflowConfig
from exporter.tracking import runs as tracking
from tests.conftest import PROJECT_ROOT, empty_store, run_sweep, tracking_uri_in
from tests.mlflow_ui import CHROMIUM, browse_sweep, serve_mlflow

# Kept after the test, for a person to look at: outputs/ is the project's, and git-ignored.
SCREENSHOTS = PROJECT_ROOT / "outputs" / "e2e" / "mlflow-ui-sweep"
# The per-shape metric whose chart a user looks for to compare backends.
PER_SHAPE_METRIC = "speedup_vs_eager"
STATUS = "tags.`status`"
SPEEDUP = "metrics.`worst_speedup_vs_eager`"
DESCRIPTION = "attributes.`Description`"
# The address `mlflow ui` serves at by default, and the `exporter` experiment's id in a store
# that jobs created.
README_SERVER, README_EXPERIMENT = "http://127.0.0.1:5000", "1"


def made_store_in(folder: Path) -> str:
    """The tracking URI of a store in `folder` whose tables are made and which holds no
    experiment of the project's yet: making the tables is no part of what these tests prove."""
    shutil.copyfile(empty_store(), folder / "mlflow.db")
    return tracking_uri_in(folder)


def shown_as_logged(cells: dict[str, str], run: Run) -> None:
    """A run's row says what its run records: its status, its worst speedup over eager (the UI
    prints a metric's shortest round-trip digits, as Python's repr does; `-` where there is
    none) and the start of its description, which the UI clips with `...`."""
    assert cells[STATUS] == run.data.tags["status"]
    speedup = run.data.metrics.get("worst_speedup_vs_eager")
    assert cells[SPEEDUP] == ("-" if speedup is None else repr(speedup).removesuffix(".0"))
    description = run.data.tags["mlflow.note.content"].replace("\n", " ")
    assert re.sub(r"\s+", " ", description).startswith(cells[DESCRIPTION].removesuffix("..."))


@pytest.mark.browser
def test_the_readmes_link_opens_a_sweep_on_its_runs_with_each_jobs_verdict_and_speedup(
    tmp_path: Path,
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium), "
            "or deselect this test with -m 'not browser'."
        )
    # Two backends, each with a batch range that works and one that cannot (min 65 > max 64).
    sweep = run_sweep(
        tmp_path,
        tmp_path / "sweep",
        "model=mlp",
        "backend=eager,executorch",
        "dynamic.batch.min=1,65",
    )
    assert sweep.exit_code == 2, sweep.output
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


def test_the_readme_gives_the_link_that_opens_the_runs_view() -> None:
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert tracking.runs_view_url(README_SERVER, README_EXPERIMENT) in readme


def test_each_job_writes_the_runs_view_on_its_experiment_until_it_is_current(
    tmp_path: Path,
) -> None:
    uri = made_store_in(tmp_path)
    cfg = MlflowConfig(
        enabled=True, tracking_uri=uri, artifact_location=str(tmp_path / "mlartifacts")
    )
    client = MlflowClient(uri)
    store = tracking.open_store(cfg)
    written = client.get_experiment(store.experiment_id).tags[tracking.RUNS_VIEW_TAG]
    view = json.loads(written)
    assert view["name"] == tracking.RUNS_VIEW_NAME
    state = json.loads(view["state"])
    assert state["selectedColumns"][:2] == [STATUS, SPEEDUP]
    assert DESCRIPTION in state["selectedColumns"]

    # A job leaves a current view as it is, and puts back one that differs.
    tracking.open_store(cfg)
    assert client.get_experiment(store.experiment_id).tags[tracking.RUNS_VIEW_TAG] == written
    client.set_experiment_tag(store.experiment_id, tracking.RUNS_VIEW_TAG, '{"state": "{}"}')
    tracking.open_store(cfg)
    rewritten = json.loads(client.get_experiment(store.experiment_id).tags[tracking.RUNS_VIEW_TAG])
    assert rewritten["state"] == view["state"]


def test_an_experiment_made_without_a_kind_becomes_a_model_development_one(
    tmp_path: Path,
) -> None:
    uri = made_store_in(tmp_path)
    files = str(tmp_path / "mlartifacts")
    client = MlflowClient(uri)
    untagged = client.create_experiment("untagged", artifact_location=files)
    chosen = client.create_experiment(
        "chosen", artifact_location=files, tags={tracking.EXPERIMENT_KIND_TAG: "genai_development"}
    )

    for name in ("untagged", "chosen", "new"):
        cfg = MlflowConfig(enabled=True, tracking_uri=uri, artifact_location=files, experiment=name)
        tracking.open_store(cfg)

    kind = tracking.EXPERIMENT_KIND_TAG
    assert client.get_experiment(untagged).tags[kind] == tracking.MODEL_DEVELOPMENT
    assert client.get_experiment(chosen).tags[kind] == "genai_development"
    assert client.get_experiment_by_name("new").tags[kind] == tracking.MODEL_DEVELOPMENT
