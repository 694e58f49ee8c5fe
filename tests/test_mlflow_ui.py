"""What the MLflow UI opens on: the README's link, the runs view each job writes on its
experiment (the columns that say how each job ended), and the experiment's kind. The UI itself
on a real sweep, in headless Chromium, is tests/test_sweep.py's (it shares that file's sweep)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mlflow.tracking import MlflowClient

from exporter.config import MlflowConfig
from exporter.tracking import runs as tracking
from tests.conftest import PROJECT_ROOT, empty_store, tracking_uri_in
from tests.mlflow_ui import DESCRIPTION, SPEEDUP, STATUS

# The address `mlflow ui` serves at by default, and the `exporter` experiment's id in a store
# that jobs created.
README_SERVER, README_EXPERIMENT = "http://127.0.0.1:5000", "1"


def made_store_in(folder: Path) -> str:
    """The tracking URI of a store in `folder` whose tables are made and which holds no
    experiment of the project's yet: making the tables is no part of what these tests prove."""
    shutil.copyfile(empty_store(), folder / "mlflow.db")
    return tracking_uri_in(folder)


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
