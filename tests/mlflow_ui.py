"""Drive a real MLflow tracking server and its web UI, for end-to-end tests of what a user sees."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run
from playwright.sync_api import Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

CHROMIUM = "/usr/bin/chromium"  # Debian's build: playwright must never download its own.
# Nothing beyond 127.0.0.1 is reachable, so anything that phones home would only stall or fail.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# The runs table is an ag-grid. A run's name cell holds its link and, for a parent, the expander
# button, which has no label or test id: the cell is the stable anchor.
RUN_NAME_CELL = '[col-id="attributes.`Run Name`"]'
RUN_LINK = f'.ag-row {RUN_NAME_CELL} a[href*="/runs/"]'
# The title of an experiment's page: "Runs", or "Overview" where the UI shows it as GenAI work.
PAGE_TITLE = "main h2"
# The runs table's columns that say how each job ended.
STATUS = "tags.`status`"
SPEEDUP = "metrics.`worst_speedup_vs_eager`"
DESCRIPTION = "attributes.`Description`"
# A run's Model metrics tab holds a card per metric, titled by the metric's name, its chart drawn
# by Plotly, which keeps the plotted traces on the chart's element.
CHART_CARD = '[data-testid="experiment-view-compare-runs-card"]'
PLOTLY_CHART = ".js-plotly-plot"


def shown_as_logged(cells: dict[str, str], run: Run) -> None:
    """A run's row says what its run records: its status, its worst speedup over eager (the UI
    prints a metric's shortest round-trip digits, as Python's repr does; `-` where there is
    none) and the start of its description, which the UI clips with `...`."""
    assert cells[STATUS] == run.data.tags["status"]
    speedup = run.data.metrics.get("worst_speedup_vs_eager")
    assert cells[SPEEDUP] == ("-" if speedup is None else repr(speedup).removesuffix(".0"))
    description = run.data.tags["mlflow.note.content"].replace("\n", " ")
    assert re.sub(r"\s+", " ", description).startswith(cells[DESCRIPTION].removesuffix("..."))


@contextmanager
def serve_mlflow(tracking_uri: str, workdir: Path, timeout_s: float = 90) -> Iterator[str]:
    """Run `mlflow server` over `tracking_uri` until the block exits; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    log_path = workdir / "mlflow-server.log"
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", tracking_uri,
        "--default-artifact-root", str(workdir / "mlartifacts"),
        # 127.0.0.1 is in the default --allowed-hosts, so the security middleware needs no flag.
        "--host", "127.0.0.1", "--port", str(port),
        # One worker starts faster, and a test sends only a handful of requests.
        "--workers", "1",
    ]  # fmt: skip
    # The job runner serves scorers and trace jobs, which no UI test uses; on, it spawns more
    # processes and leaves a temp dir in /dev/shm behind each server.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log_path.open("wb") as log:
        # A session of its own: `mlflow server` runs uvicorn as a child, which killing the CLI
        # alone would orphan, so signals go to the whole group.
        server = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            _wait_healthy(base_url, server, log_path, timeout_s)
            yield base_url
        finally:
            with suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _wait_healthy(
    base_url: str, server: subprocess.Popen, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        with (
            suppress(urllib.error.URLError, ConnectionError),  # Not listening yet.
            urllib.request.urlopen(f"{base_url}/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.25)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    state = "timed out" if server.poll() is None else f"exited with {server.returncode}"
    raise RuntimeError(f"mlflow server at {base_url} never became healthy ({state}):\n{tail}")


@dataclass(frozen=True)
class SweepView:
    """What a user sees of a sweep: the title of the page its experiment opens on, the runs
    table as it opens and once every parent is expanded (each run's name -> its cells' text by
    column id), and the points of one run's metric chart."""

    opened_on: str
    opened: dict[str, dict[str, str]]
    expanded: dict[str, dict[str, str]]
    chart_points: list[tuple[float, float]]


def browse_sweep(
    url: str,
    expect_names: list[str],
    chart_run: str,
    metric: str,
    screenshots: Path,
    timeout_s: float = 60,
) -> SweepView:
    """Open `url` in Chromium, read the runs table, expand its runs until every name in
    `expect_names` is listed and read it again, then open `chart_run` and find the chart of
    `metric` on its Model metrics tab, as a user clicks through. Saves a full-page screenshot of
    each page in `screenshots`."""
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as user_data_dir:
        # A fresh profile each time: the UI remembers in local storage which parents are open
        # and which workflow was chosen last.
        context = pw.chromium.launch_persistent_context(
            user_data_dir,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1000},
        )
        context.set_default_timeout(timeout_s * 1000)
        try:
            page = context.new_page()
            page.goto(url)
            opened_on = _settled_title(page, timeout_s)
            opened = _table(page)
            page.screenshot(path=screenshots / "opened.png", full_page=True)
            _expand_until_visible(page, expect_names, timeout_s)
            expanded = _table(page)
            page.screenshot(path=screenshots / "experiment.png", full_page=True)

            page.locator(RUN_LINK).filter(has_text=re.compile(f"^{re.escape(chart_run)}$")).click()
            page.get_by_role("tab", name="Model metrics").click()
            # Cards below the fold draw their chart only when scrolled to; searching for the
            # metric leaves its card, and those of metrics whose names contain it, on top.
            page.get_by_placeholder("Search metric charts").fill(metric)
            title = page.get_by_role("heading", name=metric, exact=True)
            plot = page.locator(CHART_CARD).filter(has=title).locator(PLOTLY_CHART)
            plot.wait_for()
            steps, values = plot.evaluate("chart => [chart.data[0].x, chart.data[0].y]")
            page.screenshot(path=screenshots / "chart.png", full_page=True)
            return SweepView(opened_on, opened, expanded, list(zip(steps, values, strict=True)))
        finally:
            context.close()


def _table(page: Page) -> dict[str, dict[str, str]]:
    """The runs listed: each one's name -> the text of its cells by column id. A row is split
    between the grid's pinned and scrolled parts, which share its row id; the grid renders only
    the columns in view, so a column scrolled out of sight is missing."""
    table = {}
    row_ids = page.locator(".ag-row[row-id]").evaluate_all(
        "rows => [...new Set(rows.map(row => row.getAttribute('row-id')))]"
    )
    for row_id in row_ids:
        row = page.locator(f'.ag-row[row-id="{row_id}"]')
        name = row.locator(f'{RUN_NAME_CELL} a[href*="/runs/"]')
        if not name.count() or not name.is_visible():
            continue
        cells = row.locator(".ag-cell[col-id]").evaluate_all(
            "cells => cells.map(cell => [cell.getAttribute('col-id'), cell.innerText.trim()])"
        )
        table[name.inner_text()] = dict(cells)
    return table


def _settled_title(page: Page, timeout_s: float) -> str:
    """The page's title once its runs are listed, or, where they never are (the page opened on
    another view), once the wait is over. While the page loads, a heading with the experiment's
    name comes and goes before the view's own: read then, a CI run saw "exporter"."""
    with suppress(PlaywrightTimeoutError):
        page.locator(RUN_LINK).first.wait_for(timeout=timeout_s * 1000)
    return page.locator(PAGE_TITLE).first.inner_text()


def _expand_until_visible(page: Page, expect_names: list[str], timeout_s: float) -> None:
    # Child runs start collapsed under their parent, and a child may be a parent itself, so this
    # expands level by level, each expander once: a second click would collapse it again.
    deadline = time.monotonic() + timeout_s
    page.locator(RUN_LINK).first.wait_for(timeout=timeout_s * 1000)
    expanded: set[str] = set()
    while True:
        visible = [link.inner_text() for link in page.locator(RUN_LINK).all() if link.is_visible()]
        if set(expect_names) <= set(visible):
            return
        if time.monotonic() > deadline:
            missing = sorted(set(expect_names) - set(visible))
            raise TimeoutError(f"runs {missing} not shown after {timeout_s}s; visible: {visible}")
        # By row id, not position: expanding a parent inserts rows and shifts those below it.
        row_ids = page.locator(".ag-row[row-id]").evaluate_all(
            "rows => rows.map(row => row.getAttribute('row-id'))"
        )
        for row_id in set(row_ids) - expanded:
            expander = page.locator(f'.ag-row[row-id="{row_id}"] {RUN_NAME_CELL} button')
            if expander.count():
                expander.click()
                expanded.add(row_id)
        time.sleep(0.25)
