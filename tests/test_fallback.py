"""The fallback policy on models with data-dependent shapes: what runs where, why, and verdicts."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.tracking.record import JobRecord
from tests.conftest import CliResult, SweepResult, job_in_process, run_exporter, run_sweep

# The op that makes each model's data-dependent count, as the edge dialect names it.
DATA_DEPENDENT_OP = {"moe": "aten.nonzero.default", "masked": "aten.index.Tensor"}


def partition(run_dir: Path) -> dict:
    return json.loads((run_dir / "partition.json").read_text())


def reasons_of(run_dir: Path, op: str) -> set[str]:
    return {node["reason"] for node in partition(run_dir)["nodes"] if node["op"] == op}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fallback")


# Two experts, one routed to per token: each still gathers a data-dependent count of tokens, and
# lowering, which costs per expert, takes half the default four's time.
MOE = ("model=moe", "model.experts=2", "model.top_k=1")
MODELS = {"moe": MOE, "masked": ("model=masked",)}
BACKENDS = ("eager", "executorch")
FALLBACKS = ("auto", "data_dependent")


@dataclass
class InProcessJob:
    record: JobRecord
    report: dict
    run_dir: Path
    # What the job logged, a line a message: the table of what runs where among them.
    log: list[str]


class CollectedLines(logging.Handler):
    """Keeps the messages logged to it, a line each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += record.getMessage().splitlines()


def logged_job(run_dir: Path, *overrides: str, cache_dir: Path) -> InProcessJob:
    """job_in_process, with what the exporter's loggers said while it ran."""
    collected = CollectedLines()
    logger = logging.getLogger("exporter")
    level = logger.level
    logger.addHandler(collected)
    logger.setLevel(logging.INFO)
    try:
        record, report = job_in_process(run_dir, *overrides, cache_dir=cache_dir)
    finally:
        logger.removeHandler(collected)
        logger.setLevel(level)
    return InProcessJob(record, report, run_dir, collected.lines)


@pytest.fixture(scope="module")
def matrix(workdir: Path) -> dict[tuple[str, str, str], InProcessJob]:
    """The issue's matrix: both models, both backends, auto and data_dependent, each job's stages
    run in this process (what they compute is the point, not the command's process: that skips
    a job process's start eight times). They build into the cache of the commands below."""
    return {
        (model, backend, fallback): logged_job(
            workdir / f"{model}-{backend}-{fallback}",
            *overrides,
            f"backend={backend}",
            f"fallback={fallback}",
            cache_dir=workdir / "cache",
        )
        for model, overrides in MODELS.items()
        for backend in BACKENDS
        for fallback in FALLBACKS
    }


@pytest.fixture(scope="module")
def sweeps(
    matrix: dict[tuple[str, str, str], InProcessJob], workdir: Path
) -> dict[str, SweepResult]:
    """The executorch half of the matrix again as commands, a sweep a model (only the MoE takes
    the overrides of its size), for what the jobs log to MLflow: they find their programs and
    artifacts in the cache the matrix built."""
    return {
        model: run_sweep(
            workdir,
            workdir / f"sweep-{model}",
            *overrides,
            "backend=executorch",
            "fallback=auto,data_dependent",
        )
        for model, overrides in MODELS.items()
    }


def job_dir(sweep: SweepResult, fallback: str) -> Path:
    (found,) = [
        path.parent.parent
        for path in sweep.sweep_dir.glob("*/.hydra/overrides.yaml")
        if f"fallback={fallback}"
        in {line.removeprefix("- ") for line in path.read_text().splitlines()}
    ]
    return found


@pytest.mark.parametrize("model", ["moe", "masked"])
def test_moe_and_masked_pass_on_eager_and_executorch_under_auto_and_data_dependent(
    matrix: dict[tuple[str, str, str], InProcessJob], sweeps: dict[str, SweepResult], model: str
) -> None:
    for backend in BACKENDS:
        for fallback in FALLBACKS:
            job = matrix[model, backend, fallback]
            assert job.record.exit_code == 0, (backend, fallback, job.record.error)
            assert job.report["passed"]
            worst = max(shape["max_abs"] for shape in job.report["shapes"])
            assert worst < 1e-5, (backend, fallback)
    sweep = sweeps[model]
    assert sweep.exit_code == 0, sweep.output
    # Each of the sweep's jobs took the program and the artifact that the matrix built.
    assert sweep.output.count("[cache] hit: lower") == 2, sweep.output
    parent, children = sweep.parent_and_children()
    assert parent.info.status == "FINISHED"
    assert len(children) == 2
    assert {run.info.status for run in children} == {"FINISHED"}
    for run in children:
        assert run.data.metrics["worst_max_abs_err"] < 1e-5, run.info.run_name


@pytest.mark.parametrize("model", ["moe", "masked"])
def test_the_partition_report_says_why_data_dependent_ops_fell_back(
    matrix: dict[tuple[str, str, str], InProcessJob], model: str
) -> None:
    op = DATA_DEPENDENT_OP[model]
    auto = matrix[model, "executorch", "auto"].run_dir
    kept_off_job = matrix[model, "executorch", "data_dependent"]
    kept_off = kept_off_job.run_dir
    assert reasons_of(auto, op) == {"unsupported by the backend"}
    assert reasons_of(kept_off, op) == {"data-dependent output shape"}
    nodes = [n for n in partition(kept_off)["nodes"] if n["op"] == op]
    # One count an expert.
    assert len(nodes) == {"moe": 2, "masked": 1}[model]
    details = {n["detail"] for n in nodes}
    assert details == {"its output size depends on tensor values (fallback=data_dependent)"}
    # The table the job prints: one row per (where, why, op).
    rows = [line.split() for line in kept_off_job.log]
    assert ["cpu", "data-dependent", "output", "shape", op, str(len(nodes))] in rows
    # Downstream of the count, XNNPACK takes nothing whose size is data-dependent; it says so.
    assert any(
        n["detail"] == "XNNPACK takes no tensor whose size is data-dependent (unbacked)"
        for n in partition(kept_off)["nodes"]
    )


@pytest.mark.parametrize("model", ["moe", "masked"])
def test_fallback_op_count_is_logged_with_the_delegated_fraction(
    sweeps: dict[str, SweepResult], model: str
) -> None:
    _, children = sweeps[model].parent_and_children()
    for fallback in FALLBACKS:
        folder = job_dir(sweeps[model], fallback)
        (run,) = [run for run in children if run.data.tags["job"] == folder.name]
        report = partition(folder)
        outside = sum(node["placement"] == "cpu" for node in report["nodes"])
        assert run.data.metrics["fallback_op_count"] == report["fallback_op_count"] == outside > 0
        assert run.data.metrics["delegated_fraction"] == pytest.approx(report["delegated_fraction"])


def test_strict_on_a_model_with_ops_off_the_backend_exits_4_listing_them(
    matrix: dict[tuple[str, str, str], InProcessJob], workdir: Path
) -> None:
    # Same cache as the matrix: strict partitions as auto does, so lowering is reused.
    result = run_exporter(workdir, *MOE, "fallback=strict")
    assert result.exit_code == 4, result.output
    assert "Traceback" not in result.output
    assert "compute nodes would run outside the XNNPACK delegate" in result.output
    assert "aten.nonzero.default x2: XNNPACK has no kernel for this op" in result.output
    assert "cache] hit: lower" in result.output
    assert not (result.run_dir / "model.pte").exists()


# What the stages partition, validated in the test's process: it skips a job process's start.
def test_unbacked_tokens_export_and_validate_under_data_dependent(tmp_path: Path) -> None:
    record, report = job_in_process(
        tmp_path, "model=masked", "dynamic.tokens.mode=unbacked", "fallback=data_dependent"
    )
    assert record.exit_code == 0, record.error
    assert report["passed"]
    assert reasons_of(tmp_path, "aten.index.Tensor") == {"data-dependent output shape"}


def test_ops_named_in_fallback_ops_stay_off_the_backend(tmp_path: Path) -> None:
    record, _ = job_in_process(tmp_path, "model=mlp", "fallback.ops=[aten.relu.default]")
    assert record.exit_code == 0, record.error
    nodes = partition(tmp_path)["nodes"]
    relus = [n for n in nodes if n["op"] == "aten.relu.default"]
    assert len(relus) == 2
    assert {(n["placement"], n["reason"]) for n in relus} == {("cpu", "named in fallback.ops")}
    others = [n for n in nodes if n["op"] != "aten.relu.default"]
    assert {n["reason"] for n in others} == {"delegated"}


def test_blocks_under_min_block_size_are_not_delegated(tmp_path: Path) -> None:
    record, _ = job_in_process(tmp_path, "model=mlp", "fallback.min_block_size=9")
    assert record.exit_code == 0, record.error
    report = partition(tmp_path)
    # Three linears, kept whole for ExecuTorch's linear kernel when not delegated, two relus.
    assert (report["delegates"], report["fallback_op_count"]) == (0, 5)
    assert {n["op"] for n in report["nodes"]} == {"aten.linear.default", "aten.relu.default"}
    assert {n["reason"] for n in report["nodes"]} == {"block too small"}
    (detail,) = {n["detail"] for n in report["nodes"]}
    assert detail == "its block had 5 compute node(s), under fallback.min_block_size=9"


def test_contradicting_fallback_settings_exit_2_before_any_work(
    exporter_cli: Callable[..., CliResult],
) -> None:
    result = exporter_cli("model=mlp", "fallback=strict", "fallback.ops=[aten.relu.default]")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "fallback=strict requires every op on the backend" in result.output
    assert not (result.run_dir / "program.pt2").exists()
