"""The command a user types, end to end: exit codes, files, and what lands in MLflow."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from exporter import config, models
from exporter.models import DynamicDim
from exporter.tracking.record import JobRecord
from exporter.validate.plan import plan
from runtimes.verdict.shapes import label
from tests.conftest import CONF_DIR, CliResult, job_in_process, run_exporter


def metric_steps(result: CliResult, run_id: str, key: str) -> list[int]:
    history = MlflowClient(result.tracking_uri).get_metric_history(run_id, key)
    return sorted(metric.step for metric in history)


def planned(result: CliResult, dim: str) -> list[int]:
    return [entry["shape"][dim] for entry in result.report()["shapes"]]


def assert_user_error(result: CliResult, code: int, *phrases: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    for phrase in phrases:
        assert phrase in result.output, result.output


def run_pte(path: Path, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return Runtime.get().load_program(path).load_method("forward").execute(list(inputs))


@pytest.fixture(scope="module")
def mlp_job(tmp_path_factory: pytest.TempPathFactory) -> CliResult:
    """model=mlp on executorch under fallback=strict: every node of an MLP is delegated."""
    return run_exporter(tmp_path_factory.mktemp("mlp"), "model=mlp", "fallback=strict")


def test_mlp_job_passes_and_writes_a_pte_executorch_runs(mlp_job: CliResult) -> None:
    assert mlp_job.exit_code == 0, mlp_job.output
    assert "passed at all 7 live shapes" in mlp_job.output
    (output,) = run_pte(mlp_job.run_dir / "model.pte", torch.randn(5, 32))
    assert output.shape == (5, 16)
    partition = (mlp_job.run_dir / "partition.json").read_text()
    assert '"delegated_fraction": 1.0' in partition


def test_mlp_job_leaves_one_finished_run_with_a_metric_per_live_size(mlp_job: CliResult) -> None:
    (run,) = mlp_job.mlflow_runs()
    assert run.info.status == "FINISHED"
    assert run.data.tags["status"] == "passed"
    assert (run.info.run_name, run.data.tags["job"]) == ("mlp-executorch", mlp_job.run_dir.name)
    # Its description, the verdict line, with the figures of its metrics.
    ratio, speedup = (
        run.data.metrics[f"worst_{key}"] for key in ("error_ratio", "speedup_vs_eager")
    )
    assert run.data.tags["mlflow.note.content"].startswith(
        f"passed (exit 0) at all 7 live shapes: worst error ratio {ratio:.3g} at "
    )
    assert f"speedup over eager {speedup:.3g}x.." in run.data.tags["mlflow.note.content"]
    assert run.data.tags["model"] == "mlp"
    assert run.data.tags["backend"] == "executorch"
    assert run.data.tags["fallback"] == "strict"
    assert run.data.params["dynamic.batch.max"] == "64"
    assert run.data.metrics["delegated_fraction"] == 1.0
    assert run.data.metrics["artifact_bytes"] == (mlp_job.run_dir / "model.pte").stat().st_size
    for key in ("export_s", "lower_s", "validate_s", "worst_max_abs_err"):
        assert key in run.data.metrics
    sizes = planned(mlp_job, "batch")
    assert sizes == [1, 2, 33, 50, 54, 63, 64]
    per_shape = ("max_abs_err", "max_rel_err", "nrmse", "latency_ms", "latency_p90_ms")
    for key in (*per_shape, "eager_latency_ms", "speedup_vs_eager"):
        assert metric_steps(mlp_job, run.info.run_id, key) == sizes
    assert run.data.tags["benchmark.clock"] == "cpu"
    assert run.data.tags["benchmark.eager_device"] == "cpu"
    assert run.data.tags["benchmark.together"] == "true"
    artifacts = {a.path for a in MlflowClient(mlp_job.tracking_uri).list_artifacts(run.info.run_id)}
    assert {"model.pte", "program.pt2", "config.yaml", ".hydra", "report.json"} <= artifacts


def test_mlp_job_records_its_peak_rss_per_stage_and_its_weight_bytes(mlp_job: CliResult) -> None:
    summary = json.loads((mlp_job.run_dir / "summary.json").read_text())
    # One entry per stage that ran, in the order they ran, whatever that order is.
    stages = list(summary["seconds"])
    assert list(summary["peak_rss_bytes"]) == stages
    assert set(stages) == {
        "config", "startup", "model", "export", "lower", "goldens", "bundle", "validate",
        "benchmark",
    }  # fmt: skip
    # The MLP's three float32 layers, 32 -> 64 -> 64 -> 16; the process holds torch besides.
    weights = (32 * 64 + 64 + 64 * 64 + 64 + 64 * 16 + 16) * 4
    assert summary["weight_bytes"] == weights
    job_peak = summary["job_peak_rss_bytes"]
    assert job_peak == max(summary["peak_rss_bytes"].values()) > 100 * weights
    assert summary["peak_rss_scope"] == "stage"
    (run,) = mlp_job.mlflow_runs()
    metrics = run.data.metrics
    assert metrics["weight_gb"] == weights / 1e9
    assert metrics["peak_rss_gb"] == job_peak / 1e9
    assert metrics["peak_rss_over_weights"] == pytest.approx(job_peak / weights)
    for stage in stages:
        assert metrics[f"{stage}_peak_rss_gb"] == summary["peak_rss_bytes"][stage] / 1e9
    assert "[validate] done in" in mlp_job.output and "peak RSS" in mlp_job.output


def test_mlp_job_times_every_live_shape_beside_eager(mlp_job: CliResult) -> None:
    report = json.loads((mlp_job.run_dir / "report.json").read_text())
    timed = report["benchmark"]
    assert timed["threads"] >= 1 and timed["eager_device"] == "cpu"
    assert [s["shape"] for s in timed["shapes"]] == [s["shape"] for s in report["shapes"]]
    for shape in timed["shapes"]:
        for timing in (shape, shape["eager"]):
            assert 0 < timing["min_ms"] <= timing["p10_ms"] <= timing["median_ms"]
            assert timing["median_ms"] <= timing["p90_ms"]
            # Up to benchmark.repeats (50) timed runs, fewer once a second has passed.
            assert 1 <= timing["runs"] <= 50
        assert shape["speedup_vs_eager"] == pytest.approx(
            shape["eager"]["median_ms"] / shape["median_ms"]
        )
    speedups = [shape["speedup_vs_eager"] for shape in timed["shapes"]]
    assert timed["worst_speedup_vs_eager"] == min(speedups)
    (run,) = mlp_job.mlflow_runs()
    assert run.data.metrics["worst_speedup_vs_eager"] == pytest.approx(min(speedups))
    assert "speedup_vs_eager" in mlp_job.output and "[benchmark] done in" in mlp_job.output


def closing_lines(output: str) -> list[str]:
    """The lines the job's output ends with that say `[job] ...`, without time and level."""
    lines = output.rstrip().splitlines()
    count = next(n for n, line in enumerate(reversed(lines)) if "][INFO] [job] " not in line)
    return [line.split("][INFO] ", 1)[1] for line in lines[len(lines) - count :]]


def test_mlp_job_ends_with_its_verdict_figures_run_dir_mlflow_link_and_time(
    mlp_job: CliResult,
) -> None:
    summary = json.loads((mlp_job.run_dir / "summary.json").read_text())
    report = mlp_job.report()
    (run,) = mlp_job.mlflow_runs()
    closing = closing_lines(mlp_job.output)
    # After everything else: the MLflow run's close comes before them.
    assert "[track] MLflow run" in mlp_job.output.splitlines()[-len(closing) - 1]
    outcome, figures, run_dir, plots, link, served_by, took = closing
    assert outcome == "[job] PASSED (exit 0) at all 7 live shapes"
    ratios = {label(entry["shape"]): entry["ratio"] for entry in report["shapes"]}
    worst = max(ratios, key=ratios.__getitem__)
    speedups = [shape["speedup_vs_eager"] for shape in report["benchmark"]["shapes"]]
    assert figures == (
        f"[job] worst error ratio {ratios[worst]:.3g} at {worst} (artifact's error / eager's); "
        f"speedup over eager {min(speedups):.3g}x..{max(speedups):.3g}x"
    )
    assert (summary["worst_error_ratio"], summary["worst_error_ratio_at"]) == (ratios[worst], worst)
    assert run_dir == f"[job] run dir: {mlp_job.run_dir}"
    assert sorted(plots.split()[2:]) == sorted(p.name for p in mlp_job.run_dir.glob("*.png"))
    assert len(plots.split()[2:]) == 3
    assert link == (
        f"[job] MLflow run: http://127.0.0.1:5000/#/experiments/{run.info.experiment_id}/runs/"
        f"{run.info.run_id}?workflowType=machine_learning"
    )
    assert served_by == f"[job]   served by: mlflow ui --backend-store-uri {mlp_job.tracking_uri}"
    seconds = float(took.removeprefix("[job] took ").removesuffix(" s"))
    assert sum(summary["seconds"].values()) <= summary["total_s"] <= seconds + 0.05
    # Every line but the link's and the command's, which cannot be wrapped.
    ended = mlp_job.output.splitlines()[-len(closing) :]
    ended = [line for line in ended if "MLflow run:" not in line and "served by:" not in line]
    assert max(map(len, ended)) <= 120


def test_native_log_lines_go_to_the_run_dirs_native_log_not_the_terminal(
    mlp_job: CliResult,
) -> None:
    # ExecuTorch's C++ runtime writes them when it loads a program (validate, benchmark).
    for native in ("cpuinfo_utils.cpp", "threadpool.cpp"):
        assert native not in mlp_job.output
        assert native in (mlp_job.run_dir / "native.log").read_text()


# One decoder layer: what is proved is the planned sizes, and lowering costs ~11 s a layer.
LLAMA = ("model=llama", "model.num_hidden_layers=1")


@pytest.fixture(scope="module")
def llama_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store and cache of the Llama's jobs: the command that lowers it again finds its
    program and artifact in the cache."""
    return tmp_path_factory.mktemp("llama")


@pytest.fixture(scope="module")
def llama_job(llama_workdir: Path) -> tuple[JobRecord, dict, Path]:
    """The Llama on executorch, its stages run in this process (what they compute is the
    point; mlp_job proves what a command logs of them): its record, report.json and run dir."""
    run_dir = llama_workdir / "in-process"
    record, report = job_in_process(run_dir, *LLAMA, cache_dir=llama_workdir / "cache")
    return record, report, run_dir


def test_llama_on_executorch_matches_eager_at_every_planned_size(
    llama_job: tuple[JobRecord, dict, Path],
) -> None:
    record, report, run_dir = llama_job
    assert record.exit_code == 0, record.error
    (logits,) = run_pte(run_dir / "model.pte", torch.randint(0, 512, (1, 9)))
    assert logits.shape == (1, 9, 512)
    sizes = [entry["shape"]["seq"] for entry in report["shapes"]]
    assert {1, 2, 65, 127, 128} <= set(sizes)
    seq = DynamicDim("seq", (("input_ids", 1),), 1, 128)
    assert sizes == [shape["seq"] for shape in plan([seq], [], 2, seed=0)]
    assert report["passed"]
    executions = [(e["shape"]["seq"], e["instance"]) for e in report["executions"]]
    down_and_up = sizes[::-1] + sizes[1:]
    assert executions == [(size, "same instance") for size in down_and_up] + [(1, "new instance")]
    assert max(entry["max_abs"] for entry in report["shapes"]) < 1e-4


def test_weights_perturbed_after_lowering_fail_validation(
    mlp_job: CliResult, exporter_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        job = config.to_job(compose("config", overrides=["model=mlp"]))
    weight = models.build(job.model, job.dynamic).module.state_dict()["2.weight"]
    data = bytearray((mlp_job.run_dir / "model.pte").read_bytes())
    original = weight.numpy().tobytes()
    offset = data.find(original)
    assert offset >= 0, "the second layer's weights are not stored verbatim in the .pte"
    data[offset : offset + len(original)] = (weight * 1.01).numpy().tobytes()
    perturbed = tmp_path / "perturbed.pte"
    perturbed.write_bytes(data)

    untouched = exporter_cli("model=mlp", f"artifact={mlp_job.run_dir / 'model.pte'}")
    assert untouched.exit_code == 0, untouched.output
    # A given artifact comes without an exported program: timed, with no eager beside it.
    timed = untouched.report()["benchmark"]
    assert timed["eager_device"] is None and timed["worst_speedup_vs_eager"] is None
    assert all(s["median_ms"] > 0 and s["eager"] is None for s in timed["shapes"])

    # The verdict is the point; naming the node (a search that lowers again) is test_localize's.
    result = exporter_cli("model=mlp", f"artifact={perturbed}", "validate.localize=off")
    assert_user_error(
        result, 1, "less accurate than eager at the model's dtype", "smallest validate.factor"
    )
    report = result.report()
    assert not report["passed"]
    assert all(not shape["passed"] for shape in report["shapes"])
    outcome = closing_lines(result.output)[0]
    failed = ", ".join(label(shape["shape"]) for shape in report["shapes"])
    said = "[job] FAILED (exit 1) at the validate stage: 7 of 7 live shapes failed: "
    # Clipped to a 120-column terminal: report.json has them all.
    assert outcome.startswith(said) and (said + failed).startswith(outcome.removesuffix("…"))
    (run,) = result.mlflow_runs()
    assert run.info.status == "FAILED"
    assert run.data.tags["failed_stage"] == "validate"
    assert run.data.metrics["worst_max_abs_err"] > 1e-3


def test_an_artifact_the_runtime_cannot_load_exits_5(
    exporter_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program" * 100)
    result = exporter_cli("model=mlp", f"artifact={junk}")
    assert_user_error(result, 5, f"cannot load {junk}")
    (run,) = result.mlflow_runs()
    assert (run.info.status, run.data.tags["failed_stage"]) == ("FAILED", "runtime")


def test_strict_fallback_fails_lowering_and_lists_the_ops_left_outside(
    llama_job: tuple[JobRecord, dict, Path], llama_workdir: Path
) -> None:
    # The in-process job's cache: strict partitions as auto does, so lowering is reused.
    result = run_exporter(llama_workdir, *LLAMA, "fallback=strict")
    assert_user_error(result, 4, "fallback=strict", "outside the XNNPACK delegate", "aten.")
    assert "cache] hit: lower" in result.output
    assert closing_lines(result.output)[0].startswith(
        "[job] FAILED (exit 4) at the lower stage: fallback=strict: "
    )
    assert not (result.run_dir / "model.pte").exists()
    assert (result.run_dir / "program.pt2").exists()
    (run,) = result.mlflow_runs()
    assert run.info.status == "FAILED"
    assert run.data.tags["failed_stage"] == "lower"


def test_eager_backend_validates_the_exported_program_without_mlflow_cache_or_benchmark(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=mlp", "backend=eager", "mlflow=off", "cache=off", "benchmark=off")
    assert result.exit_code == 0, result.output
    assert result.report()["passed"]
    assert "benchmark" not in result.report()
    assert "benchmark" not in json.loads((result.run_dir / "summary.json").read_text())["seconds"]
    assert not (result.run_dir / "model.pte").exists()
    assert not (result.run_dir.parent / "mlflow.db").exists()
    # cache=off builds in the run dir itself: no cache, and no staging folder left behind.
    assert not (result.run_dir.parent / "cache").exists()
    assert (result.run_dir / "program.pt2").stat().st_size > 0
    assert not list(result.run_dir.glob(".partial-*"))
    assert json.loads((result.run_dir / "summary.json").read_text())["cache_hits"] == {}


@pytest.mark.parametrize(
    ("overrides", "phrases"),
    [
        (["dynamic.seq.min=300"], ["dynamic.seq: min (300) is greater than max (128)"]),
        (["backend=tflite"], ["Could not find 'backend/tflite'", "eager", "executorch"]),
        (["model=mlp", "validate.extra_shapes=[65]"], ["65, outside dynamic.batch bounds [1, 64]"]),
        (["model.checkpoint=/no/such/dir"], ["model.checkpoint=/no/such/dir: no such directory"]),
    ],
)
def test_bad_configuration_exits_2_with_a_clear_message(
    exporter_cli: Callable[..., CliResult], overrides: list[str], phrases: list[str]
) -> None:
    result = exporter_cli(*overrides)
    assert_user_error(result, 2, *phrases)
    if result.run_dir.exists():
        # Refused by the schema once Hydra composed the job: the job's closing lines say so.
        assert closing_lines(result.output)[0].startswith("[job] FAILED (exit 2) at the config")


def test_an_mlflow_store_that_cannot_open_stops_the_job_before_any_work(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=mlp", "mlflow.tracking_uri=foo://bar")
    assert_user_error(result, 2, "cannot open the MLflow store at mlflow.tracking_uri=foo://bar")
    assert not (result.run_dir / "program.pt2").exists()
