"""How far a decode step is from the GPU's memory limit: the floor of reading the artifact's bytes
at the card's peak bandwidth, as CUDA describes the card's memory, and each decode step's time over
it in the benchmark's table, report.json, the job's summary and its MLflow metrics. CI has no
GPU: the floor of a card is computed here from the figures CUDA reports for one, and the GPU
check (tests/gpu_check.py) prints it for every KV-cache case on a real card."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.benchmark import Benchmark, CallLatency, memory_floor
from exporter.benchmark.memory_floor import MemoryFloor
from exporter.benchmark.timing import Timing
from exporter.config import MlflowConfig
from exporter.tracking import runs as tracking
from exporter.tracking.comparison import JobSummary
from exporter.tracking.record import JobRecord


@dataclass
class H100Sxm:
    """What torch.cuda.get_device_properties reports of an H100 SXM's memory: HBM3 at 2619 MHz
    on a 5120-bit bus."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_clock_rate: int = 2_619_000
    memory_bus_width: int = 5120


def test_the_peak_bandwidth_is_the_data_sheets_from_the_memory_clock_and_bus() -> None:
    # Two transfers per clock, 640 bytes each: the H100 SXM's 3.35 TB/s.
    assert memory_floor.peak_bandwidth(H100Sxm()) == pytest.approx(3.352e12, rel=1e-4)


def test_no_floor_off_a_gpu() -> None:
    assert memory_floor.on("cpu", 10**9) is None


def call(position: int, tokens: int, ms: float) -> CallLatency:
    return CallLatency(position, tokens, Timing("cuda", (ms, ms, ms), None, None), None)


def test_each_decode_step_is_judged_against_the_floor_and_the_slowest_reaches_the_run(
    tmp_path: Path,
) -> None:
    # llama_1b's bfloat16 artifact (2.81 GB with its cache) on an H100: a floor of 0.838 ms.
    floor = MemoryFloor("NVIDIA H100", memory_floor.peak_bandwidth(H100Sxm()), 2_810_000_000)
    assert floor.ms == pytest.approx(0.8383, rel=1e-3)
    decode = (call(127, 1, 1.7), call(511, 1, 1.9), call(1023, 1, 1.8))
    timed = Benchmark(1, "cuda", (), (call(0, 128, 20.0),), decode, True, floor)
    assert timed.floor_ratios() == pytest.approx([1.7 / floor.ms, 1.9 / floor.ms, 1.8 / floor.ms])
    payload = timed.to_json()
    assert payload["floor"]["read_bytes"] == 2_810_000_000
    assert [step["floor_ratio"] for step in payload["decode"]] == timed.floor_ratios()
    # A prefill computes more than it reads: no floor ratio beside it.
    assert "floor_ratio" not in payload["prefill"][0]
    lines = timed.table().splitlines()
    assert "over the floor (0.838 ms)" in lines[0]
    assert not lines[2].rstrip().endswith("x")
    assert lines[4].rstrip().endswith(f"{1.9 / floor.ms:.2f}x")
    record = JobRecord(run_dir=tmp_path / "run", benchmark=timed)
    record.run_dir.mkdir()
    summary = JobSummary.of(record, {})
    assert summary.worst_decode_floor_ratio == pytest.approx(1.9 / floor.ms)
    assert "decode at worst 2.27x the memory floor" in summary.verdict()
    # The run: the slowest step's ratio, and each step's at its cache fill.
    store = tracking.open_store(MlflowConfig(True, f"sqlite:///{tmp_path}/mlflow.db"))
    run_id = tracking.start_run(store, "floor", record.started_ms, {}, {})
    tracking.end_run(store, run_id, record, summary)
    logged = store.client.get_run(run_id).data.metrics
    assert logged["worst_decode_floor_ratio"] == pytest.approx(1.9 / floor.ms)
    history = store.client.get_metric_history(run_id, "decode_floor_ratio")
    assert {m.step: m.value for m in history} == pytest.approx(
        {127: 1.7 / floor.ms, 511: 1.9 / floor.ms, 1023: 1.8 / floor.ms}
    )


def test_without_a_floor_the_table_and_report_are_as_on_a_cpu() -> None:
    timed = Benchmark(2, "cpu", (), (call(0, 8, 2.0),), (call(7, 1, 0.5),), True)
    assert timed.floor_ratios() == []
    assert "floor" not in timed.to_json()
    assert "floor_ratio" not in timed.to_json()["decode"][0]
    assert "floor" not in timed.table()
