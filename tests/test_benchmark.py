"""The benchmark's timing: counts, budgets and statistics, on a real exported program run by
the eager runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter.benchmark import timing
from runtimes import load


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
