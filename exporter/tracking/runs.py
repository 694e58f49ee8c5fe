"""The tracking stage: one MLflow run per job, opened RUNNING when the job starts and closed
with its status when it ends.

Through MlflowClient: the run exists from the job's start with its params and Hydra's choices,
so a job that is stopped or whose process dies still has a run (closed KILLED or FAILED with
the stage it was in); its figures, files and status are written at the end. Nothing but this
module talks to the store. A sweep's jobs are nested under the sweep's parent run, a target's
check of a job's artifact (`python -m exporter track`) under the job's run. Imported only
where tracking is on: a job with mlflow=off never imports mlflow.

Jobs of a parallel sweep write to one SQLite file from several processes; SQLite lets one
writer in at a time and makes the others fail with "database is locked" after a timeout, so
every use of a SQLite store here holds a lock file beside the database first.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from exporter.config import MlflowConfig
from exporter.errors import (
    ConfigError,
    DiskFull,
    ExporterError,
    TrackingFailed,
    TrackingUnavailable,
)
from exporter.process.memory import GB
from exporter.tracking import server as tracking_server
from exporter.tracking.comparison import JobSummary
from exporter.tracking.record import OUTCOMES, JobRecord, now_ms
from runtimes.files import PARTIAL_PREFIX, NoRoom, error_chain, no_room_error, written_path
from runtimes.formats.bundle import MANIFEST
from runtimes.verdict.report import Report
from runtimes.verdict.shapes import label, steps

if TYPE_CHECKING:
    # Imports torch, which a job's tracking does not need.
    from exporter.benchmark import Benchmark
    from exporter.quantize.verdict import Quality

log = logging.getLogger(__name__)

# log_batch's limits per call (MLflow REST API).
_MAX_PARAMS, _MAX_METRICS, _MAX_TAGS = 100, 1000, 100
# MLflow retries a failed HTTP request 7 times with exponential backoff, about four minutes in
# all; a server that stopped answering should cost a job seconds. A user's own setting wins.
_HTTP_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
# The kind of work an experiment holds, as MLflow's UI names it (its ExperimentKind values; the
# Python package has no constant for them): models trained or exported, not GenAI traces. The UI
# writes it when a user picks a kind. MLflow 3.17.2's UI does not read it when it opens an
# experiment: the URL's `workflowType`, else the browser's last toggle, picks GenAI or Model
# training (runs_view_url).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"
# A view of the runs table that MLflow's UI opens from a link (`viewStateShareKey`) and lists
# among the experiment's saved views: an experiment tag holding the table's columns, as the UI
# writes one when a user saves a view (3.17.2: JSON {name, createdAt, updatedAt, state}, the
# state a JSON string). Right of each run's name and start, how it ended: its status, worst
# speedup over eager, worst error over eager's own and the verdict line (its description).
RUNS_VIEW_KEY = "exporter"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW_NAME = "exporter: verdict and speed"
RUNS_VIEW_COLUMNS = {
    # Column id (the UI's canonical key) -> width in pixels (None: the UI's own).
    "tags.`status`": 90,
    "metrics.`worst_speedup_vs_eager`": 170,
    "metrics.`worst_error_ratio`": 130,
    "attributes.`Description`": 420,
    "tags.`backend`": None,
    "tags.`model`": None,
}
# The run dir's name of the job a run records: a sweep's job folder (`1-llama-executorch`).
JOB_TAG = "job"
# The metrics a validation report gives at each live shape's step, and the statistic of each.
PER_SHAPE_METRICS = {
    "max_abs_err": "max_abs",
    "max_rel_err": "max_rel",
    "nrmse": "nrmse",
    # Eager's errors at the model's dtype, and the artifact's over them.
    "ref_max_abs_err": "ref_max_abs",
    "ref_nrmse": "ref_nrmse",
    "error_ratio": "ratio",
    # Next-token logits' predictions against the oracle's, the artifact's and eager's.
    "top1_agreement": "top1",
    "ref_top1_agreement": "ref_top1",
    "kl_mean": "kl_mean",
    "ref_kl_mean": "ref_kl_mean",
    "kl_max": "kl_max",
    "ref_kl_max": "ref_kl_max",
}


@dataclass(frozen=True)
class Store:
    client: MlflowClient
    experiment_id: str
    uri: str


def open_store(cfg: MlflowConfig) -> Store:
    """Opens the store and its experiment before the job's work, so a bad URI costs nothing;
    a tracking server that does not answer fails in seconds, naming the URI."""
    with _opening(cfg.tracking_uri):
        client = MlflowClient(tracking_uri=_prepared_uri(cfg.tracking_uri))
        return Store(client, _experiment_id(client, cfg), cfg.tracking_uri)


def open_job_run(uri: str, run_id: str) -> tuple[Store, Run]:
    """The store at `uri`, which must exist, and the job's run `run_id` in it; the store's
    experiment is the run's. ConfigError where the store has no such run."""
    missing = f"MLflow run {run_id} is not in the store at mlflow.tracking_uri={uri}"
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ConfigError(f"{missing}: there is no database file there")
    with _opening(uri):
        client = MlflowClient(tracking_uri=uri)
        try:
            run = client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise
            raise ConfigError(
                f"{missing}; give the store that holds it (mlflow.tracking_uri=URI)"
            ) from None
        return Store(client, run.info.experiment_id, uri), run


@contextmanager
def _opening(uri: str) -> Iterator[None]:
    """Opens the store at `uri` inside, each failure raised as TrackingUnavailable naming it."""
    if tracking_server.is_server(uri):
        for name, value in _HTTP_RETRIES.items():
            os.environ.setdefault(name, value)
        tracking_server.probe(uri)
    try:
        with _serialized(uri):
            yield
    except ExporterError:
        raise
    # Whatever stops the store from opening (a bad URI, a path that cannot be written, a server
    # that answers with an error) surfaces as a different exception type; all mean the same.
    except Exception as error:
        if (full := _full_store(error, uri)) is not None:
            raise full from None
        raise TrackingUnavailable(
            f"cannot open the MLflow store at mlflow.tracking_uri={uri}: {error}"
        ) from error


def start_run(
    store: Store,
    run_name: str,
    start_ms: int,
    params: Mapping[str, str],
    tags: Mapping[str, str],
    parent_run_id: str | None = None,
) -> str:
    """Opens a job's run, RUNNING, with its params and tags (nested under `parent_run_id`)."""
    tags = {"status": OUTCOMES["RUNNING"], **tags}
    if parent_run_id:
        tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
    run_id = _create_run(store, start_ms, run_name)
    with _written(store, run_id, TrackingUnavailable), _serialized(store.uri):
        _log_batched(store.client, run_id, params, [], tags)
    log.info("[track] MLflow run %s (RUNNING) in %s", run_id, store.uri)
    return run_id


def end_run(store: Store, run_id: str, record: JobRecord, summary: JobSummary) -> None:
    """Records the ended job on its run: its summary's figures and tags, so the run and the
    comparison table say the same, the run dir's files, and its status."""
    with _written(store, run_id):
        with _serialized(store.uri):
            tags = {**_tags(summary), **_step_tags(record.report)}
            _log_batched(store.client, run_id, {}, _metrics(record, summary), tags)
        # Files go to the artifact store, not the database: other jobs need not wait for them.
        _log_run_dir(store, run_id, record)
        artifact = record.artifact
        if artifact and not artifact.path.is_relative_to(record.run_dir):
            for path in artifact.files():
                store.client.log_artifact(run_id, str(path))
        with _serialized(store.uri):
            store.client.set_terminated(run_id, record.status, end_time=record.ended_ms or now_ms())
    log.info("[track] MLflow run %s (%s) in %s", run_id, record.status, store.uri)


def _log_run_dir(store: Store, run_id: str, record: JobRecord) -> None:
    """The run dir's files; of its bundle only the manifest, which lists the rest: the bundle's
    artifact is the run's own, and its goldens would only copy the cache's."""
    for path in sorted(record.run_dir.iterdir()):
        # A file being written (or left by a killed writer) is not one of the job's results.
        if path.name.startswith(PARTIAL_PREFIX):
            continue
        if record.bundle is not None and path == record.bundle.folder:
            store.client.log_artifact(run_id, str(path / MANIFEST), path.name)
        elif path.is_dir():
            store.client.log_artifacts(run_id, str(path), path.name)
        else:
            store.client.log_artifact(run_id, str(path))


def end_sweep_run(
    store: Store,
    run_id: str,
    status: str,
    metrics: Mapping[str, float],
    tags: Mapping[str, str],
    files: Iterable[Path],
) -> None:
    """Logs the sweep's comparison on its parent run and closes it with `status`."""
    at = now_ms()
    with _written(store, run_id):
        for path in files:
            store.client.log_artifact(run_id, str(path))
        with _serialized(store.uri):
            metric_list = [Metric(key, value, at, 0) for key, value in metrics.items()]
            _log_batched(store.client, run_id, {}, metric_list, tags)
            store.client.set_terminated(run_id, status, end_time=now_ms())


def fail_lost_job_run(store: Store, parent_run_id: str, job: str, error: str) -> None:
    """Closes FAILED, with `error`, the run of a sweep's job whose folder is `job` if it is
    still RUNNING: its job's process died with no one left to close it."""
    run_id = child_run_tagged(store, parent_run_id, JOB_TAG, job)
    if run_id is None:
        return
    with _written(store, run_id), _serialized(store.uri):
        if store.client.get_run(run_id).info.status != "RUNNING":
            return
        tags = {
            "status": OUTCOMES["FAILED"],
            "error": error,
            "mlflow.note.content": f"no result: {error}",
        }
        _log_batched(store.client, run_id, {}, [], tags)
        store.client.set_terminated(run_id, "FAILED", end_time=now_ms())


def child_run_tagged(store: Store, parent_run_id: str, key: str, value: str) -> str | None:
    """The id of a run nested under `parent_run_id` whose tag `key` is `value`, if one is."""
    query = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}' AND tags.`{key}` = '{value}'"
    try:
        with _serialized(store.uri):
            runs = store.client.search_runs([store.experiment_id], query, max_results=1)
    except Exception as error:
        raise TrackingUnavailable(f"cannot search the MLflow store {store.uri}: {error}") from error
    return runs[0].info.run_id if runs else None


def log_target_run(
    store: Store,
    parent_run_id: str,
    run_name: str,
    tags: Mapping[str, str],
    report: Report | None,
    check_s: float,
    report_file: Path,
    status: str,
    started_ms: int,
) -> str:
    """Logs a target's check of a job's artifact as a closed run nested under the job's, with
    `status` (FINISHED or FAILED): the report's figures as the job logs its own, so both plot
    alike, the check's seconds, `tags` and the report file. `tags` are written last, after the
    file, so a run that could not be written whole lacks them."""
    ended_ms = started_ms + round(check_s * 1000)
    opened = {"status": OUTCOMES["RUNNING"], MLFLOW_PARENT_RUN_ID: parent_run_id}
    run_id = _create_run(store, started_ms, run_name, opened, TrackingFailed)
    metrics = [Metric("check_s", check_s, ended_ms, 0)]
    if report:
        metrics += report_metrics(report, ended_ms)
    kept = f"{report_file} is unchanged: attach it again once the store can be written."
    with _written(store, run_id, kept=kept):
        store.client.log_artifact(run_id, str(report_file))
        with _serialized(store.uri):
            _log_batched(store.client, run_id, {}, metrics, {**_step_tags(report), **tags})
            store.client.set_terminated(run_id, status, end_time=ended_ms)
    log.info("[track] MLflow run %s (%s) in %s", run_id, status, store.uri)
    return run_id


def _create_run(
    store: Store,
    start_ms: int,
    run_name: str,
    tags: Mapping[str, str] | None = None,
    failure: type[ExporterError] = TrackingUnavailable,
) -> str:
    try:
        with _serialized(store.uri):
            run = store.client.create_run(
                store.experiment_id, start_time=start_ms, tags=tags, run_name=run_name
            )
    except Exception as error:
        if (full := _full_store(error, store.uri)) is not None:
            raise full from None
        raise failure(f"cannot create an MLflow run in {store.uri}: {error}") from error
    return run.info.run_id


@contextmanager
def _written(
    store: Store,
    run_id: str,
    failure: type[ExporterError] = TrackingFailed,
    kept: str = "The run dir keeps the job's results.",
) -> Iterator[None]:
    """Writes to a created run: if one fails, the run is closed as FAILED where the store still
    answers, not left RUNNING, and `failure` is raised, saying what `kept` the results."""
    try:
        yield
    except Exception as error:
        full = _full_store(error, store.uri, (store, run_id))
        try:
            with _serialized(store.uri):
                store.client.set_terminated(run_id, "FAILED", end_time=now_ms())
        except Exception as closing:
            # A full store refuses the closing too, for the reason the full disk's line says.
            if full is None:
                log.error("[track] MLflow run %s could not be closed either: %s", run_id, closing)
        if full is not None:
            raise full from None
        raise failure(
            f"MLflow run {run_id} could not be written to {store.uri}: {error}. {kept}"
        ) from error


def _full_store(
    error: BaseException, uri: str, run: tuple[Store, str] | None = None
) -> DiskFull | None:
    """DiskFull where a write to the store found no room: a file of `run` copied to its artifact
    folder, or SQLite's database, whose "database or disk is full" names no errno."""
    found = no_room_error(error)
    if found is not None and written_path(found) is None and run is not None:
        # MLflow's copy into the run's artifact folder names neither file.
        folder = _artifact_folder(*run)
        if folder is not None:
            found = NoRoom(found.errno, "the MLflow run's files", folder)
    sqlite_full = any(
        isinstance(cause, sqlite3.Error) and cause.sqlite_errorcode == sqlite3.SQLITE_FULL
        for cause in error_chain(error)
    )
    if found is None and sqlite_full and uri.startswith("sqlite:///"):
        found = NoRoom(errno.ENOSPC, "the MLflow store", Path(uri.removeprefix("sqlite:///")))
    return None if found is None else DiskFull(found, "track")


def _artifact_folder(store: Store, run_id: str) -> Path | None:
    """The folder of the run's artifacts where it is on this machine; None where it is not, or
    the store cannot say."""
    try:
        artifact_uri = urlparse(store.client.get_run(run_id).info.artifact_uri)
    except Exception:
        return None
    return Path(artifact_uri.path) if artifact_uri.scheme in ("", "file") else None


@contextmanager
def _serialized(uri: str) -> Iterator[None]:
    """Holds `<database>.lock` for a SQLite store, so one process at a time writes to it."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(_prepared_uri(uri).removeprefix("sqlite:///") + ".lock")
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _prepared_uri(uri: str) -> str:
    # SQLite creates the file but not its folder.
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri


def _experiment_id(client: MlflowClient, cfg: MlflowConfig) -> str:
    """The experiment's id, created as a model-development experiment where it is missing; an
    experiment without a kind (made before jobs set one) gets it, one with a kind keeps it. The
    runs view is written where it is missing or differs."""
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is None:
        try:
            return client.create_experiment(
                cfg.experiment,
                artifact_location=cfg.artifact_location or None,
                tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT, RUNS_VIEW_TAG: _runs_view()},
            )
        except MlflowException:
            # Another job created it since we looked.
            experiment = client.get_experiment_by_name(cfg.experiment)
            if experiment is None:
                raise
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
    if _view_of(experiment.tags.get(RUNS_VIEW_TAG)) != _view_of(_runs_view()):
        client.set_experiment_tag(experiment.experiment_id, RUNS_VIEW_TAG, _runs_view())
    return experiment.experiment_id


def runs_view_url(base_url: str, experiment_id: str) -> str:
    """The link that opens an experiment on its runs, in the columns of RUNS_VIEW_COLUMNS.

    The runs tab's own path: MLflow 3.17.2's UI drops the view's key from the link when it
    redirects from the experiment's page to a tab. `workflowType` shows the experiment as model
    training, not as GenAI work (traces, judges), whatever the browser chose last.
    """
    query = f"workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY}"
    return f"{base_url}/#/experiments/{experiment_id}/runs?{query}"


def _runs_view() -> str:
    """The runs view's tag value. It sets no order: sorted by anything but the start, the UI
    lists a sweep's jobs beside its parent instead of under it. A sweep's parent opens closed
    (a view cannot open it), with its jobs' worst figures in its own columns."""
    state = {
        "selectedColumns": list(RUNS_VIEW_COLUMNS),
        # Run Name and Created stay first (pinned); the run's duration goes after these.
        "columnOrder": [*RUNS_VIEW_COLUMNS, "duration"],
        "columnWidths": {column: px for column, px in RUNS_VIEW_COLUMNS.items() if px},
    }
    created = now_ms()
    return json.dumps(
        {
            "name": RUNS_VIEW_NAME,
            "createdAt": created,
            "updatedAt": created,
            "state": json.dumps(state),
        }
    )


def _view_of(tag: str | None) -> tuple[str, str] | None:
    """A runs view's name and state, without the times it was written."""
    try:
        view = json.loads(tag) if tag else None
        return (view["name"], view["state"]) if isinstance(view, dict) else None
    except (ValueError, KeyError):
        return None


def _metrics(record: JobRecord, summary: JobSummary) -> list[Metric]:
    """The summary's figures, as the comparison table shows them, the report's, and the
    benchmark's per shape."""
    at = record.ended_ms or now_ms()
    metrics = [Metric(f"{stage}_s", seconds, at, 0) for stage, seconds in summary.seconds.items()]
    metrics += [
        Metric(f"{stage}_peak_rss_gb", peak / GB, at, 0)
        for stage, peak in summary.peak_rss_bytes.items()
    ]
    metrics += [Metric(key, value, at, 0) for key, value in summary.metrics().items()]
    if record.report:
        metrics += report_metrics(record.report, at)
    if record.quality and record.report:
        metrics += _quality_metrics(record.quality, record.report, at)
    if record.attribution:
        metrics += [
            Metric(f"attribution.kld_mean.{layer.name}", layer.quality.kld_mean, at, 0)
            for layer in record.attribution.worst()
        ]
    if record.benchmark:
        metrics += _call_metrics(record.benchmark, at)
    if record.benchmark and record.benchmark.shapes and record.report:
        for timed, size in zip(record.benchmark.shapes, steps(record.report.shapes), strict=True):
            per_shape = {
                "latency_ms": timed.artifact.median_ms,
                "latency_p10_ms": timed.artifact.p10_ms,
                "latency_p90_ms": timed.artifact.p90_ms,
                "eager_latency_ms": timed.eager.median_ms if timed.eager else None,
                "speedup_vs_eager": timed.speedup_vs_eager,
            }
            metrics += [Metric(k, v, at, size) for k, v in per_shape.items() if v is not None]
    return metrics


def _call_metrics(timed: Benchmark, at: int) -> list[Metric]:
    """A model with a KV cache: each prefill's figures stepped by its length, each decode step's
    by its cache fill (the position it writes), on a GPU with its time over the memory floor."""
    metrics = [
        Metric("decode_floor_ratio", ratio, at, call.position)
        for call, ratio in zip(timed.decode, timed.floor_ratios(), strict=False)
    ]
    for kind, calls in (("prefill", timed.prefill), ("decode", timed.decode)):
        for call in calls:
            figures = {
                f"{kind}_ms": call.artifact.median_ms,
                f"{kind}_tokens_per_s": call.tokens_per_s,
                f"eager_{kind}_ms": call.eager.median_ms if call.eager else None,
                f"eager_{kind}_tokens_per_s": call.eager_tokens_per_s,
                f"{kind}_speedup_vs_eager": call.speedup_vs_eager,
            }
            step = call.tokens if kind == "prefill" else call.position
            metrics += [Metric(k, v, at, step) for k, v in figures.items() if v is not None]
    return metrics


def report_metrics(report: Report, at: int) -> list[Metric]:
    """A validation report's figures, the job's and a target's alike: the worst over the live
    shapes, and each shape's at its step, so MLflow plots them against the shape. A model with
    a KV cache: each judged step's figures under its session's name (`session0.max_abs_err`) at
    its position, and the greedy generation's agreement."""
    worst = {
        "worst_max_abs_err": "max_abs",
        "worst_nrmse": "nrmse",
        "needed_atol": "needed_atol",
        "worst_error_ratio": "ratio",
        "needed_factor": "needed_factor",
        "worst_top1_agreement": "top1",
        "worst_kl_mean": "kl_mean",
        "worst_kl_max": "kl_max",
    }
    # NaN: not measured (no eager reference at the model's dtype for a ratio, no logits).
    metrics = [
        Metric(metric, report.worst(stat), at, 0)
        for metric, stat in worst.items()
        if not math.isnan(report.worst(stat))
    ]
    if report.sessions:
        return metrics + _session_metrics(report, at)
    for result, size in zip(report.by_shape(), steps(report.shapes), strict=True):
        metrics += [
            Metric(metric, result.stats[stat], at, size)
            for metric, stat in PER_SHAPE_METRICS.items()
            if not math.isnan(result.stats[stat])
        ]
    return metrics


def _quality_metrics(quality: Quality, report: Report, at: int) -> list[Metric]:
    """A quantized artifact's quality against the float model: over every judged position
    (`quality.kld_mean`, the quantized model's in eager beside it), on the quality text
    (`quality.text.kld_mean`, `quality.text.top1`, `quality.text.perplexity_ratio`, and
    `quality.text.eager.*`, `quality.text.llama_cpp.*`), then per live shape at its
    step (`shape.quality.kld_mean`) or, with a KV cache, per session at each judged step's
    position (`session0.quality.kld_mean`)."""
    figures: dict[str, float] = {"quality.passed": float(quality.passed)}
    for who, found in (("quality", quality.artifact), ("quality.eager", quality.eager)):
        if found is not None:
            figures |= {f"{who}.{k}": v for k, v in found.to_json().items() if k != "positions"}
    if quality.text is not None:
        for who in ("artifact", "eager", "llama_cpp"):
            prefix = "quality.text" if who == "artifact" else f"quality.text.{who}"
            figures |= {
                f"{prefix}.{k}": v for k, v in quality.text.get(who, {}).items() if k != "positions"
            }
    metrics = [Metric(key, value, at, 0) for key, value in figures.items()]
    cases = quality.artifact_per_case
    if report.sessions:
        places = [(f"session{s['session']}.quality", s["pos"], label(s)) for s in report.shapes]
    else:
        places = [
            ("shape.quality", step, label(shape))
            for shape, step in zip(report.shapes, steps(report.shapes), strict=True)
        ]
    for prefix, step, key in places:
        if key in cases:
            measured = cases[key].to_json()
            metrics += [
                Metric(f"{prefix}.{stat}", measured[stat], at, step)
                for stat in ("kld_mean", "kld_max", "top1", "prob_drop")
            ]
    return metrics


def _session_metrics(report: Report, at: int) -> list[Metric]:
    """Per session, each judged step's figures at its position (the prefill's at 0), so that
    MLflow plots error against position, a line per session; the greedy generation's tokens
    and how many of them each pair of generations shares before they part."""
    metrics = [
        Metric(f"session{result.number}.{metric}", step.stats[stat], at, step.shape["pos"])
        for result in report.by_session()
        for step in result.judged
        for metric, stat in PER_SHAPE_METRICS.items()
        if not math.isnan(step.stats[stat])
    ]
    if report.generation:
        metrics.append(Metric("greedy_tokens", len(report.generation.oracle), at, 0))
        metrics += [
            Metric(f"greedy_agreed_{pair}", agreed, at, 0)
            for pair, agreed in report.generation.agreement().items()
        ]
    return metrics


def _step_tags(report: Report | None) -> dict[str, str]:
    """With several dynamic dims a metric's step is the shape's position in the plan; these
    tags say which shape each step is (`step.3` = `batch=8,seq=1`). None for sessions, whose
    step is the position."""
    shapes = report.shapes if report else ()
    if not shapes or len(shapes[0]) < 2 or report.sessions:
        return {}
    return {f"step.{n}": label(shape) for n, shape in zip(steps(shapes), shapes, strict=True)}


def _tags(summary: JobSummary) -> dict[str, str]:
    """The summary's tags (JobSummary.tags), with how the job ended, Hydra's choices, whether
    any stage's work came from the cache, and the quality verdict in words."""
    tags = {"status": summary.status, "exit_code": str(summary.exit_code), **summary.choices}
    tags |= summary.tags()
    if summary.cache_hits:
        tags["cache_hit"] = str(any(summary.cache_hits.values())).lower()
    if summary.quality_passed is not None:
        tags["quality"] = "passed" if summary.quality_passed else "failed"
    # The run's description in MLflow's UI, and a column of the runs view: the verdict, then
    # the whole error where the verdict shows only its first line.
    tags["mlflow.note.content"] = summary.verdict()
    if summary.error:
        tags["error"] = summary.error[:5000]
        if "\n" in summary.error:
            tags["mlflow.note.content"] += f"\n\n{summary.error}"
    return tags


def _log_batched(
    client: MlflowClient,
    run_id: str,
    params: Mapping[str, str],
    metrics: list[Metric],
    tags: Mapping[str, str],
) -> None:
    for chunk in _chunks([Param(k, v) for k, v in params.items()], _MAX_PARAMS):
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks(metrics, _MAX_METRICS):
        client.log_batch(run_id, metrics=chunk)
    for chunk in _chunks([RunTag(k, v) for k, v in tags.items()], _MAX_TAGS):
        client.log_batch(run_id, tags=chunk)


def _chunks(items: list, size: int) -> Iterable[list]:
    return (items[start : start + size] for start in range(0, len(items), size))
