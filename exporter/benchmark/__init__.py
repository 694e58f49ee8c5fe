"""The benchmark stage: the artifact's latency at every live shape, beside eager PyTorch's.

Separate from validation, which runs each shape once or twice to judge its numbers: here each
shape is warmed up, then timed many times, and summarized by its median and spread. Eager runs
the exported program at the model's dtype on the same kind of device, timed the same way with
the same CPU threads, so `speedup_vs_eager` says whether lowering paid off at that shape. The
two are loaded together and take turns (exporter/benchmark/timing.py), so a machine that slows
down slows both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tabulate import tabulate

from exporter.benchmark.timing import Timing, measure
from exporter.config import BenchmarkConfig
from exporter.process import interrupts
from runtimes import Loaded, set_threads
from runtimes.verdict.shapes import LiveShape, label

log = logging.getLogger(__name__)

__all__ = ["Benchmark", "ShapeLatency", "Subject", "run", "thread_count"]


@dataclass(frozen=True)
class Subject:
    """What is timed: an artifact by its runtime's name, the device it runs on, its loader."""

    runtime: str
    device: str
    load: Callable[[], Loaded]


@dataclass(frozen=True)
class ShapeLatency:
    shape: LiveShape
    artifact: Timing
    eager: Timing | None

    @property
    def speedup_vs_eager(self) -> float | None:
        """Eager's median over the artifact's: above 1, the artifact is faster."""
        if self.eager is None:
            return None
        return self.eager.median_ms / self.artifact.median_ms


@dataclass(frozen=True)
class Benchmark:
    threads: int
    # Where eager ran, or None where there was no exported program to run (artifact=...).
    eager_device: str | None
    shapes: tuple[ShapeLatency, ...]

    def worst_speedup_vs_eager(self) -> float | None:
        speedups = [s.speedup_vs_eager for s in self.shapes if s.speedup_vs_eager is not None]
        return min(speedups) if speedups else None

    def table(self) -> str:
        headers = ["shape", "median_ms", "p10_ms", "p90_ms", "runs", "eager_ms", "eager_p90_ms"]
        rows = []
        for result in self.shapes:
            timing, eager = result.artifact, result.eager
            rows.append(
                [
                    label(result.shape),
                    f"{timing.median_ms:.3f}",
                    f"{timing.p10_ms:.3f}",
                    f"{timing.p90_ms:.3f}",
                    len(timing.samples_ms),
                    f"{eager.median_ms:.3f}" if eager else "",
                    f"{eager.p90_ms:.3f}" if eager else "",
                    _speedup(result.speedup_vs_eager),
                ]
            )
        return tabulate(rows, headers=[*headers, "speedup_vs_eager"], disable_numparse=True)

    def to_json(self) -> dict[str, object]:
        return {
            "threads": self.threads,
            "eager_device": self.eager_device,
            "worst_speedup_vs_eager": self.worst_speedup_vs_eager(),
            "shapes": [
                {
                    "shape": result.shape,
                    **result.artifact.to_json(),
                    "eager": result.eager.to_json() if result.eager else None,
                    "speedup_vs_eager": result.speedup_vs_eager,
                }
                for result in self.shapes
            ],
        }


def thread_count(settings: BenchmarkConfig) -> int:
    """`benchmark.threads`, or every core this process may run on."""
    return settings.threads or len(os.sched_getaffinity(0))


def run(
    shapes: Sequence[LiveShape],
    inputs: Callable[[LiveShape], Sequence[torch.Tensor]],
    artifact: Subject,
    eager: Subject | None,
    settings: BenchmarkConfig,
) -> Benchmark:
    """Times the artifact and eager (None: no program to run in eager PyTorch) at every shape,
    in plan order."""
    threads = thread_count(settings)
    for subject in (artifact, eager):
        if subject is not None:
            set_threads(subject.runtime, threads)
    log.info(
        "[benchmark] %d live shapes, %d threads: %d warm-up runs, then up to %d timed runs or "
        "%.3g s per shape and runtime",
        len(shapes),
        threads,
        settings.warmup,
        settings.repeats,
        settings.seconds,
    )
    loaded = artifact.load()
    reference = eager.load() if eager is not None else None
    if reference is None:
        log.info("[benchmark] no exported program to run in eager PyTorch: no speedup_vs_eager")
    results = []
    for shape in shapes:
        interrupts.check()
        contenders = [loaded] if reference is None else [loaded, reference]
        timing, *eager_timing = measure(
            contenders, inputs(shape), settings.warmup, settings.repeats, settings.seconds
        )
        result = ShapeLatency(shape, timing, eager_timing[0] if eager_timing else None)
        results.append(result)
        log.info(
            "[benchmark] %-12s %.3f ms (p10 %.3f, p90 %.3f, %d runs)  eager %s  speedup %s",
            label(shape),
            timing.median_ms,
            timing.p10_ms,
            timing.p90_ms,
            len(timing.samples_ms),
            f"{result.eager.median_ms:.3f} ms" if result.eager else "-",
            _speedup(result.speedup_vs_eager),
        )
    return Benchmark(threads, eager.device if eager else None, tuple(results))


def _speedup(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"
