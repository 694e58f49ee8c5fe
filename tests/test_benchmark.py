"""The benchmark's timing: counts, budgets and statistics, and whether the two contenders are
loaded at once, on a real exported program run by the eager runtime."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from exporter import benchmark
from exporter.benchmark import timing
from exporter.config import BenchmarkConfig
from exporter.process import memory
from runtimes import Loaded, load


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("program") / "program.pt2"
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    torch.export.save(torch.export.export(module, (torch.randn(4, 32),)), path)
    return path


def test_each_contender_is_timed_repeats_times_after_its_warm_up(program: Path) -> None:
    loaded = load(program, "eager", "cpu")
    timed, beside = timing.measure([loaded] * 2, [torch.randn(4, 32)], 2, repeats=7, seconds=60)
    assert len(timed.samples_ms) == len(beside.samples_ms) == 7
    assert timed.clock == "cpu"
    assert 0 < timed.min_ms <= timed.p10_ms <= timed.median_ms <= timed.p90_ms
    assert timed.upload_ms >= 0 and timed.download_ms >= 0


def test_the_time_budget_stops_the_runs_after_at_least_one(program: Path) -> None:
    loaded = load(program, "eager", "cpu")
    (timed,) = timing.measure([loaded], [torch.randn(4, 32)], 100, repeats=100, seconds=1e-6)
    assert len(timed.samples_ms) == 1
    assert timed.median_ms == timed.p10_ms == timed.p90_ms == timed.min_ms


class Counted:
    """A loaded runtime that counts its computations."""

    def __init__(self, loaded: object) -> None:
        self.loaded = loaded
        self.clock = loaded.clock
        self.executions = 0

    def upload(self, inputs: list[torch.Tensor]) -> object:
        return self.loaded.upload(inputs)

    def execute(self, resident: object) -> object:
        self.executions += 1
        return self.loaded.execute(resident)

    def download(self, produced: object) -> tuple[torch.Tensor, ...]:
        return self.loaded.download(produced)


def test_runs_longer_than_the_budget_take_one_warm_up_and_one_timed_run_each(
    program: Path,
) -> None:
    contenders = [Counted(load(program, "eager", "cpu")) for _ in range(2)]
    timed = timing.measure(contenders, [torch.randn(4, 32)], 5, repeats=50, seconds=1e-9)
    assert [len(t.samples_ms) for t in timed] == [1, 1]
    assert [c.executions for c in contenders] == [2, 2]


def test_turns_switch_with_one_untimed_run_then_time_up_to_five(program: Path) -> None:
    contenders = [Counted(load(program, "eager", "cpu")) for _ in range(2)]
    timed = timing.measure(contenders, [torch.randn(4, 32)], 2, repeats=7, seconds=60)
    # 2 warm-up runs, then turns of 5 and 2 timed runs, each after one untimed run.
    assert [len(t.samples_ms) for t in timed] == [7, 7]
    assert [c.executions for c in contenders] == [2 + 1 + 5 + 1 + 2] * 2


def test_percentiles_interpolate_between_ranks() -> None:
    samples = tuple(float(x) for x in range(1, 12))
    timed = timing.Timing("cpu", samples, None, None)
    assert (timed.p10_ms, timed.median_ms, timed.p90_ms, timed.min_ms) == (2.0, 6.0, 10.0, 1.0)
    assert timing.Timing("cpu", (1.0, 2.0), None, None).p90_ms == pytest.approx(1.9)


def subject(program: Path, file_bytes: int = 0) -> benchmark.Subject:
    return benchmark.Subject("eager", "cpu", lambda: load(program, "eager", "cpu"), file_bytes)


def settings(together: bool | None) -> BenchmarkConfig:
    return BenchmarkConfig(enabled=True, warmup=1, repeats=3, seconds=60, together=together)


def test_the_two_are_loaded_at_once_unless_that_would_pass_the_jobs_peak(program: Path) -> None:
    holding, gb = memory.resident(), 10**9
    small, large = subject(program, 10**6), subject(program, gb)
    assert benchmark.together(settings(None), small, small, holding + gb)
    # The job holds its peak already (a CUDA job's stages), but both are small beside it.
    assert benchmark.together(settings(None), small, small, holding)
    # A 1B model's artifact and program: both at once would set the job's peak.
    assert not benchmark.together(settings(None), large, large, holding + gb)
    assert benchmark.together(settings(True), large, large, holding)
    assert not benchmark.together(settings(False), small, small, holding + gb)
    assert benchmark.together(settings(None), large, None, holding)
    assert benchmark.together(settings(None), large, large, None)


@pytest.mark.parametrize("together", [False, True])
def test_apart_each_is_loaded_once_the_other_has_gone(program: Path, together: bool) -> None:
    loaded: list[weakref.ref] = []
    others_alive: list[int] = []

    def loading() -> Loaded:
        others_alive.append(sum(ref() is not None for ref in loaded))
        instance = load(program, "eager", "cpu")
        loaded.append(weakref.ref(instance))
        return instance

    shapes = [{"batch": 4}, {"rows": 4}]
    contender = benchmark.Subject("eager", "cpu", loading)
    timed = benchmark.run(
        shapes, lambda _shape: [torch.randn(4, 32)], contender, contender, settings(together)
    )
    assert others_alive == ([0, 1] if together else [0, 0])
    assert timed.together is together and timed.to_json()["together"] is together
    assert [s.shape for s in timed.shapes] == shapes
    for shape in timed.shapes:
        assert shape.eager is not None
        assert len(shape.artifact.samples_ms) == len(shape.eager.samples_ms) == 3
