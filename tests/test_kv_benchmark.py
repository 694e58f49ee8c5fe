"""The benchmark of a model with a KV cache: prefill at seq's min, middle and max from position
0, a decode step at the first decode step's fill, half the cache and its last slot, beside
eager running the same cache; in report.json, MLflow's metrics and the comparison's summary."""

from __future__ import annotations

import json

import pytest

from exporter import backends
from exporter.job import stages
from exporter.job.produced import Produced
from exporter.tracking.comparison import JobSummary
from exporter.tracking.record import JobRecord
from exporter.tracking.runs import _metrics
from tests.test_audit import composed
from tests.test_kv_cache import SMALL

# A few runs per call: the figures' consistency is checked, not their size.
QUICK = ("benchmark.warmup=0", "benchmark.seconds=0.01", "benchmark.repeats=3")


@pytest.fixture(scope="module")
def benchmarked(tmp_path_factory: pytest.TempPathFactory) -> tuple[JobRecord, dict]:
    run_dir = tmp_path_factory.mktemp("kv-benchmark")
    job = composed("backend=executorch", *SMALL, *QUICK, "mlflow=off", "cache=false")
    record, produced = JobRecord(run_dir=run_dir), Produced()
    stages.run(job, backends.configured(job), produced, record, lambda *_: None)
    produced.into(record)
    return record, json.loads((run_dir / stages.REPORT_FILE).read_text())


def test_prefill_and_decode_are_timed_beside_eager(benchmarked: tuple[JobRecord, dict]) -> None:
    _, report = benchmarked
    timed = report["benchmark"]
    # Prefills of the sessions' lengths, each from position 0.
    assert [(c["position"], c["tokens"]) for c in timed["prefill"]] == [(0, 1), (0, 9), (0, 16)]
    # A decode step after the shortest prefill, at half the 16 slots and at the last slot.
    assert [(c["position"], c["tokens"]) for c in timed["decode"]] == [(1, 1), (8, 1), (15, 1)]
    assert timed["shapes"] == []
    speedups = []
    for call in timed["prefill"] + timed["decode"]:
        assert 0 < call["min_ms"] <= call["median_ms"] <= call["p90_ms"]
        assert call["runs"] >= 1
        assert call["tokens_per_s"] == pytest.approx(call["tokens"] * 1e3 / call["median_ms"])
        eager = call["eager"]
        assert eager["median_ms"] > 0
        assert call["eager_tokens_per_s"] == pytest.approx(
            call["tokens"] * 1e3 / eager["median_ms"]
        )
        assert call["speedup_vs_eager"] == pytest.approx(eager["median_ms"] / call["median_ms"])
        speedups.append(call["speedup_vs_eager"])
    assert timed["worst_speedup_vs_eager"] == pytest.approx(min(speedups))


def test_mlflow_gets_tokens_per_second_stepped_by_length_and_fill(
    benchmarked: tuple[JobRecord, dict],
) -> None:
    record, report = benchmarked
    metrics = _metrics(record, JobSummary.of(record, {}))
    steps = {}
    for metric in metrics:
        steps.setdefault(metric.key, {})[metric.step] = metric.value
    decode = {c["position"]: c for c in report["benchmark"]["decode"]}
    prefill = {c["tokens"]: c for c in report["benchmark"]["prefill"]}
    assert steps["decode_ms"] == {p: c["median_ms"] for p, c in decode.items()}
    assert steps["decode_tokens_per_s"] == {p: c["tokens_per_s"] for p, c in decode.items()}
    assert steps["eager_decode_ms"].keys() == {1, 8, 15}
    assert steps["decode_speedup_vs_eager"].keys() == {1, 8, 15}
    assert steps["prefill_tokens_per_s"] == {s: c["tokens_per_s"] for s, c in prefill.items()}
    assert steps["prefill_speedup_vs_eager"].keys() == {1, 9, 16}
    # The live shapes' latency is for models without a cache.
    assert "latency_ms" not in steps


def test_the_comparison_gets_decode_and_prefill_tokens_per_second(
    benchmarked: tuple[JobRecord, dict],
) -> None:
    record, report = benchmarked
    summary = JobSummary.of(record, {})
    assert summary.decode_tokens_per_s == report["benchmark"]["decode"][-1]["tokens_per_s"]
    assert summary.prefill_tokens_per_s == report["benchmark"]["prefill"][-1]["tokens_per_s"]
    assert summary.worst_speedup_vs_eager == report["benchmark"]["worst_speedup_vs_eager"]
    assert summary.latency_ms == [] and summary.latency_at_max_ms is None
    assert summary.benchmark["clock"] == "cpu"
    decode = f"decode {summary.decode_tokens_per_s:.0f} tokens/s at the last slot"
    assert decode in summary.figures()
