"""The MLflow UI shows a real sweep: an MLflow server over the store the sweep filled, its
experiment opened in headless Chromium on its runs, the parent run and every job's run listed,
and a job's per-shape metric plotted against the live size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from exporter import tracking
from exporter.config import MlflowConfig
from tests.conftest import PROJECT_ROOT, run_sweep
from tests.mlflow_ui import CHROMIUM, browse_sweep, serve_mlflow

# Kept after the test, for a person to look at: outputs/ is the project's, and git-ignored.
SCREENSHOTS = PROJECT_ROOT / "outputs" / "e2e" / "mlflow-ui-sweep"
# The per-shape metric whose chart a user looks for to compare backends.
PER_SHAPE_METRIC = "speedup_vs_eager"


@pytest.mark.browser
def test_the_mlflow_ui_opens_a_sweep_on_its_runs_and_charts_a_metric_per_live_size(
    tmp_path: Path,
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium), "
            "or deselect this test with -m 'not browser'."
        )
    sweep = run_sweep(tmp_path, tmp_path / "sweep", "model=mlp", "backend=eager,executorch")
    assert sweep.exit_code == 0, sweep.output
    parent, children = sweep.parent_and_children()
    names = [parent.info.run_name, *(run.info.run_name for run in children)]
    assert len(names) == 3
    (lowered,) = [run for run in children if run.data.tags["backend"] == "executorch"]
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
            base_url,
            parent.info.experiment_id,
            names,
            lowered.info.run_name,
            PER_SHAPE_METRIC,
            SCREENSHOTS,
        )

    assert shown.opened_on == "Runs"
    assert set(names) <= set(shown.run_names), shown.run_names
    # The values travel as JSON from the store to the chart, so they arrive exactly.
    assert shown.chart_points == logged
    for screenshot in ("experiment.png", "chart.png"):
        assert (SCREENSHOTS / screenshot).stat().st_size > 20_000


def test_an_experiment_made_without_a_kind_becomes_a_model_development_one(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
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
