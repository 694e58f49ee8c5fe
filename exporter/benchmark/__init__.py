"""The benchmark stage: the artifact's latency at every live shape, beside eager PyTorch's.

Separate from validation, which runs each shape once or twice to judge its numbers: here each
shape is warmed up, then timed many times, and summarized by its median and spread. Eager runs
the exported program at the model's dtype on the same kind of device, timed the same way with
the same CPU threads, so `speedup_vs_eager` says whether lowering paid off at that shape. The
two are loaded together and take turns (exporter/benchmark/timing.py), so a machine that slows
down slows both; where holding both would take the job past the peak memory it reached before
(a 1B model's artifact and program), one is timed and freed before the other is loaded.

A model with a KV cache is timed as it generates instead (exporter/benchmark/decoding.py):
prefill at several lengths and a decode step at several cache fills, each with tokens per
second, the live shapes (its validation's steps) untimed; on a GPU, each decode step's time over
the floor of reading the artifact's bytes at the card's memory bandwidth
(exporter/benchmark/memory_floor.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from tabulate import tabulate

from exporter.benchmark import memory_floor
from exporter.benchmark.decoding import CallLatency, decode_fills, time_decode, time_prefill
from exporter.benchmark.memory_floor import MemoryFloor
from exporter.benchmark.timing import Timing, measure, speedup
from exporter.config import BenchmarkConfig
from exporter.process import interrupts, memory
from runtimes import Loaded, set_threads
from runtimes.verdict.shapes import LiveShape, label

log = logging.getLogger(__name__)

__all__ = [
    "Benchmark",
    "CallLatency",
    "ShapeLatency",
    "Subject",
    "run",
    "run_sessions",
    "thread_count",
]


@dataclass(frozen=True)
class Subject:
    """What is timed: an artifact by its runtime's name, the device it runs on, its loader, and
    the bytes of the files it loads (what it will hold, near enough)."""

    runtime: str
    device: str
    load: Callable[[], Loaded]
    file_bytes: int = 0


@dataclass(frozen=True)
class ShapeLatency:
    shape: LiveShape
    artifact: Timing
    eager: Timing | None

    @property
    def speedup_vs_eager(self) -> float | None:
        return speedup(self.artifact, self.eager)


@dataclass(frozen=True)
class Benchmark:
    threads: int
    # Where eager ran, or None where there was no exported program to run (artifact=...).
    eager_device: str | None
    shapes: tuple[ShapeLatency, ...]
    # A model with a KV cache: its prefills from position 0, and its decode steps by cache fill.
    prefill: tuple[CallLatency, ...] = ()
    decode: tuple[CallLatency, ...] = ()
    # Whether the artifact and eager were loaded at once, taking turns, or one after the other.
    together: bool = True
    # A KV-cache artifact on a GPU: the time to read its bytes at the card's peak bandwidth.
    floor: MemoryFloor | None = None

    def worst_speedup_vs_eager(self) -> float | None:
        timed = [*self.shapes, *self.prefill, *self.decode]
        speedups = [t.speedup_vs_eager for t in timed if t.speedup_vs_eager is not None]
        return min(speedups) if speedups else None

    def floor_ratios(self) -> list[float]:
        """Each decode step's time over the memory floor, by cache fill (none off a GPU)."""
        if self.floor is None:
            return []
        return [self.floor.ratio(call.artifact.median_ms) for call in self.decode]

    def table(self) -> str:
        if self.prefill or self.decode:
            return self._calls_table()
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

    def _calls_table(self) -> str:
        headers = ["call", "median_ms", "p90_ms", "runs", "tokens/s", "eager_ms", "eager_tokens/s"]
        headers.append("speedup_vs_eager")
        if self.floor is not None:
            headers.append(f"over the floor ({self.floor.ms:.3g} ms)")
        # A prefill computes more than it reads: the floor is a decode step's.
        over_floor = [""] * len(self.prefill) + [f"{r:.2f}x" for r in self.floor_ratios()]
        rows = []
        for kind, calls in (("prefill", self.prefill), ("decode", self.decode)):
            for call in calls:
                timing, eager = call.artifact, call.eager
                where = f"seq={call.tokens}" if kind == "prefill" else f"pos={call.position}"
                rows.append(
                    [
                        f"{kind} {where}",
                        f"{timing.median_ms:.3f}",
                        f"{timing.p90_ms:.3f}",
                        len(timing.samples_ms),
                        f"{call.tokens_per_s:.1f}",
                        f"{eager.median_ms:.3f}" if eager else "",
                        f"{call.eager_tokens_per_s:.1f}" if eager else "",
                        _speedup(call.speedup_vs_eager),
                    ]
                )
        if self.floor is not None:
            rows = [[*row, ratio] for row, ratio in zip(rows, over_floor, strict=True)]
        return tabulate(rows, headers=headers, disable_numparse=True)

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "threads": self.threads,
            "eager_device": self.eager_device,
            "together": self.together,
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
        if self.prefill or self.decode:
            payload["prefill"] = [call.to_json() for call in self.prefill]
            payload["decode"] = [call.to_json() for call in self.decode]
            for step, ratio in zip(payload["decode"], self.floor_ratios(), strict=False):
                step["floor_ratio"] = ratio
        if self.floor is not None:
            payload["floor"] = self.floor.to_json()
        return payload


def thread_count(settings: BenchmarkConfig) -> int:
    """`benchmark.threads`, or every core this process may run on."""
    return settings.threads or len(os.sched_getaffinity(0))


def run(
    shapes: Sequence[LiveShape],
    inputs: Callable[[LiveShape], Sequence[torch.Tensor]],
    artifact: Subject,
    eager: Subject | None,
    settings: BenchmarkConfig,
    job_peak: int | None = None,
) -> Benchmark:
    """Times the artifact and eager (None: no program to run in eager PyTorch) at every shape,
    in plan order; `job_peak`: the job's peak RSS so far (`together`)."""
    threads = thread_count(settings)
    log.info(
        "[benchmark] %d live shapes, %d threads: %d warm-up runs, then up to %d timed runs or "
        "%.3g s per shape and runtime",
        len(shapes),
        threads,
        settings.warmup,
        settings.repeats,
        settings.seconds,
    )

    def time_all(contenders: Sequence[Loaded]) -> list[list[Timing]]:
        return [
            measure(contenders, inputs(shape), settings.warmup, settings.repeats, settings.seconds)
            for shape in _interruptible(shapes)
        ]

    at_once = together(settings, artifact, eager, job_peak)
    results = []
    for shape, (timing, *eager_timing) in zip(
        shapes, _timed(artifact, eager, threads, at_once, time_all), strict=True
    ):
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
    return Benchmark(threads, eager.device if eager else None, tuple(results), together=at_once)


def run_sessions(
    sessions: Sequence[dict],
    artifact: Subject,
    eager: Subject | None,
    settings: BenchmarkConfig,
    job_peak: int | None = None,
) -> Benchmark:
    """Times the artifact with a KV cache and eager (None: no program to run in eager PyTorch)
    on the first session's tokens (plain dicts as runtimes/verdict/sessions.py reads them): a
    prefill of every session's length from position 0, then a decode step at the fills of
    `decode_fills`; each instance keeps its cache between its calls, as in a generation."""
    threads = thread_count(settings)
    tokens = sessions[0]["tokens"]
    lengths = sorted({int(session["prefill"]) for session in sessions})
    fills = decode_fills(lengths[0], tokens.shape[0])
    log.info(
        "[benchmark] prefill of %s tokens, a decode step at cache fills %s; %d threads: %d "
        "warm-up runs, then up to %d timed runs or %.3g s per call and runtime",
        lengths,
        fills,
        threads,
        settings.warmup,
        settings.repeats,
        settings.seconds,
    )

    def time_all(contenders: Sequence[Loaded]) -> list[list[Timing]]:
        return [
            *(time_prefill(contenders, tokens, length, settings) for length in lengths),
            *(time_decode(contenders, tokens, fill, lengths[-1], settings) for fill in fills),
        ]

    at_once = together(settings, artifact, eager, job_peak)
    calls = [(f"prefill seq={n}", 0, n) for n in lengths] + [
        (f"decode pos={fill}", fill, 1) for fill in fills
    ]
    timings = _timed(artifact, eager, threads, at_once, time_all)
    timed = [_call(*call, timing) for call, timing in zip(calls, timings, strict=True)]
    prefill, decode = timed[: len(lengths)], timed[len(lengths) :]
    floor = memory_floor.on(artifact.device, artifact.file_bytes)
    return Benchmark(
        threads,
        eager.device if eager else None,
        (),
        tuple(prefill),
        tuple(decode),
        at_once,
        floor,
    )


def _call(name: str, position: int, tokens: int, timings: Sequence[Timing]) -> CallLatency:
    timing, *eager_timing = timings
    call = CallLatency(position, tokens, timing, eager_timing[0] if eager_timing else None)
    log.info(
        "[benchmark] %s %.3f ms (p90 %.3f, %d runs), %.1f tokens/s  eager %s  speedup %s",
        name,
        timing.median_ms,
        timing.p90_ms,
        len(timing.samples_ms),
        call.tokens_per_s,
        f"{call.eager.median_ms:.3f} ms" if call.eager else "-",
        _speedup(call.speedup_vs_eager),
    )
    return call


def together(
    settings: BenchmarkConfig, artifact: Subject, eager: Subject | None, job_peak: int | None
) -> bool:
    """Whether the artifact and eager are loaded at once and take turns: `benchmark.together`,
    or where it is null, where their files' bytes on top of what the process holds now stay
    within `job_peak`, the peak the job reached before (unknown: at once), or where the
    smaller of the two is under a tenth of that peak (a small model, whose RSS after a CUDA
    job's stages can sit at the peak already). Export and lowering set a job's memory; the
    benchmark, which can time the two apart, should not."""
    if eager is None:
        return True
    if settings.together is not None:
        return settings.together
    if job_peak is None:
        return True
    holding, loading = memory.resident(), artifact.file_bytes + eager.file_bytes
    # Apart, the job holds the larger one at a time: what both at once add is the smaller.
    if holding + loading <= job_peak or min(artifact.file_bytes, eager.file_bytes) < job_peak / 10:
        return True
    log.info(
        "[benchmark] the artifact and eager one after the other, each loaded alone: their "
        "files (%.2f GB) on the %.2f GB the job holds would pass its peak so far (%.2f GB); "
        "benchmark.together=true times them in turns",
        loading / memory.GB,
        holding / memory.GB,
        job_peak / memory.GB,
    )
    return False


def _timed(
    artifact: Subject,
    eager: Subject | None,
    threads: int,
    at_once: bool,
    time_all: Callable[[Sequence[Loaded]], list[list[Timing]]],
) -> list[list[Timing]]:
    """Per call that `time_all(contenders)` times, a Timing of the artifact then of eager
    (where there is a program to run), their kernels set to `threads` CPU threads: loaded at
    once and taking turns, or each loaded, timed and freed before the next."""
    subjects = [artifact] if eager is None else [artifact, eager]
    for subject in subjects:
        set_threads(subject.runtime, threads)
    if eager is None:
        log.info("[benchmark] no exported program to run in eager PyTorch: no speedup_vs_eager")
    if at_once:
        return time_all([subject.load() for subject in subjects])
    apart = []
    for subject in subjects:
        apart.append(time_all([subject.load()]))
        memory.release_freed()
    return [[t for timings in call for t in timings] for call in zip(*apart, strict=True)]


def _interruptible(shapes: Sequence[LiveShape]) -> Iterator[LiveShape]:
    """The shapes, stopping between two where the user interrupted the job."""
    for shape in shapes:
        interrupts.check()
        yield shape


def _speedup(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"
