"""The MLflow UI shows a real sweep: an MLflow server over the store the sweep filled, its
experiment page opened in headless Chromium, the parent run and every job's run listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT, run_sweep
from tests.mlflow_ui import CHROMIUM, open_experiment, serve_mlflow

# Kept after the test, for a person to look at: outputs/ is the project's, and git-ignored.
SCREENSHOT = PROJECT_ROOT / "outputs" / "e2e" / "mlflow-ui-sweep.png"


@pytest.mark.browser
def test_the_mlflow_ui_lists_the_runs_of_a_sweep(tmp_path: Path) -> None:
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

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with serve_mlflow(sweep.tracking_uri, tmp_path) as base_url:
        shown = open_experiment(base_url, parent.info.experiment_id, SCREENSHOT, names)

    assert set(names) <= set(shown), shown
    assert SCREENSHOT.stat().st_size > 20_000
