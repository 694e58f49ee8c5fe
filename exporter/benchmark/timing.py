"""Timing one loaded artifact on one input: warm-up runs, then timed runs until a count or a
time budget, the computation timed apart from the copies where the runtime offers its steps."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from runtimes import Loaded

# What times a runtime that offers only `run`: the host's clock around all of it.
WHOLE_RUN = "host, copies included"
# Timed runs a contender takes in a row on its turn, after one untimed run. A runtime's worker
# threads spin a moment after its run ends (XNNPACK's pool), and the first run after a switch
# pays for them: eager timed right after a .pte ran was 12 to 27% slower than eager alone, and
# 3% slower once one run had gone before it.
_TURN = 5


@dataclass(frozen=True)
class Timing:
    """The timed runs of one artifact at one shape, in ms. `clock` says what timed them;
    `upload_ms` and `download_ms` are the median copies to and from the target, timed apart
    (None where `run` was timed whole)."""

    clock: str
    samples_ms: tuple[float, ...]
    upload_ms: float | None
    download_ms: float | None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        return _percentile(self.samples_ms, 0.10)

    @property
    def p90_ms(self) -> float:
        return _percentile(self.samples_ms, 0.90)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    def to_json(self) -> dict[str, object]:
        return {
            "clock": self.clock,
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "min_ms": self.min_ms,
            "runs": len(self.samples_ms),
            "upload_ms": self.upload_ms,
            "download_ms": self.download_ms,
        }


def speedup(artifact: Timing, eager: Timing | None) -> float | None:
    """Eager's median over the artifact's: above 1, the artifact is faster; None without
    eager."""
    return None if eager is None else eager.median_ms / artifact.median_ms


def measure(
    contenders: Sequence[Loaded],
    inputs: Sequence[torch.Tensor],
    warmup: int,
    repeats: int,
    seconds: float,
) -> list[Timing]:
    """Times each of `contenders` on `inputs`, taking turns, so that a machine that slows down
    for a moment slows each of them alike: `warmup` untimed runs each, then turns of up to
    `_TURN` timed runs each, until `repeats` runs or `seconds` per contender (counted from the
    first warm-up) have passed; at least one run of each kind. Python's garbage collector is
    off meanwhile: a collection would land in one sample."""
    rounds = [
        _timed_steps(contender, inputs)
        if hasattr(contender, "execute")
        else _timed_run(contender, inputs)
        for contender in contenders
    ]
    deadline = time.perf_counter() + seconds * len(contenders)
    collecting = gc.isenabled()
    gc.disable()
    try:
        for run_once in rounds:
            for _ in range(max(warmup, 1)):
                run_once()
                if time.perf_counter() > deadline:
                    break
        samples: list[list[_Sample]] = [[] for _ in contenders]
        while not samples[0] or (len(samples[0]) < repeats and time.perf_counter() <= deadline):
            # Past the deadline only for the first turn of runs that each outlast the budget
            # (a 1B model on the CPU): one timed run each, and no switch, whose threads' spin
            # is nothing beside such a run.
            within = time.perf_counter() <= deadline
            turn = min(_TURN, repeats - len(samples[0])) if within else 1
            for run_once, taken in zip(rounds, samples, strict=True):
                if len(rounds) > 1 and within:
                    # The switch: this run pays for the threads the other left spinning.
                    run_once()
                taken.extend(run_once() for _ in range(turn))
    finally:
        if collecting:
            gc.enable()
    return [_timing(c, taken) for c, taken in zip(contenders, samples, strict=True)]


def _timing(loaded: Loaded, samples: Sequence[_Sample]) -> Timing:
    computed = tuple(sample.compute_ms for sample in samples)
    if not hasattr(loaded, "execute"):
        return Timing(WHOLE_RUN, computed, None, None)
    return Timing(
        loaded.clock,
        computed,
        statistics.median(sample.upload_ms for sample in samples),
        statistics.median(sample.download_ms for sample in samples),
    )


@dataclass(frozen=True)
class _Sample:
    compute_ms: float
    upload_ms: float = math.nan
    download_ms: float = math.nan


def _timed_steps(loaded: Loaded, inputs: Sequence[torch.Tensor]) -> Callable[[], _Sample]:
    """One run in the runtime's three steps, each copy on the host's clock (they return once
    done) and the computation on the runtime's: CUDA events, or the host's."""
    cuda = loaded.clock == "cuda"

    def run_once() -> _Sample:
        start = time.perf_counter()
        resident = loaded.upload(inputs)
        uploaded = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            produced = loaded.execute(resident)
            end.record()
            end.synchronize()
            compute_ms = begin.elapsed_time(end)
        else:
            produced = loaded.execute(resident)
            compute_ms = (time.perf_counter() - uploaded) * 1e3
        computed = time.perf_counter()
        loaded.download(produced)
        return _Sample(compute_ms, (uploaded - start) * 1e3, (time.perf_counter() - computed) * 1e3)

    return run_once


def _timed_run(loaded: Loaded, inputs: Sequence[torch.Tensor]) -> Callable[[], _Sample]:
    def run_once() -> _Sample:
        start = time.perf_counter()
        loaded.run(inputs)
        return _Sample((time.perf_counter() - start) * 1e3)

    return run_once


def _percentile(samples: Sequence[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
