"""The benchmark stage: the artifact's latency at every live shape, beside eager PyTorch's.

Separate from validation, which runs each shape once or twice to judge its numbers: here each
shape is warmed up, then timed many times, and summarized by its median and spread. Eager runs
the exported program at the model's dtype on the same kind of device, timed the same way with
the same CPU threads, so `speedup_vs_eager` says whether lowering paid off at that shape. The
two are loaded together and take turns (exporter/benchmark/timing.py), so a machine that slows
down slows both.

A model with a KV cache is timed as it generates instead (exporter/benchmark/decoding.py):
prefill at several lengths and a decode step at several cache fills, each with tokens per
second, the live shapes (its validation's steps) untimed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tabulate import tabulate

from exporter.benchmark.decoding import CallLatency, decode_fills, time_decode, time_prefill
from exporter.benchmark.timing import Timing, measure, speedup
from exporter.config import BenchmarkConfig
from exporter.process import interrupts
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

    def worst_speedup_vs_eager(self) -> float | None:
        timed = [*self.shapes, *self.prefill, *self.decode]
        speedups = [t.speedup_vs_eager for t in timed if t.speedup_vs_eager is not None]
        return min(speedups) if speedups else None

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
        return tabulate(rows, headers=[*headers, "speedup_vs_eager"], disable_numparse=True)

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
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
        if self.prefill or self.decode:
            payload["prefill"] = [call.to_json() for call in self.prefill]
            payload["decode"] = [call.to_json() for call in self.decode]
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
) -> Benchmark:
    """Times the artifact and eager (None: no program to run in eager PyTorch) at every shape,
    in plan order."""
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
    contenders = _loaded(artifact, eager, threads)
    results = []
    for shape in shapes:
        interrupts.check()
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


def run_sessions(
    sessions: Sequence[dict], artifact: Subject, eager: Subject | None, settings: BenchmarkConfig
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
    contenders = _loaded(artifact, eager, threads)
    prefill = [
        _call(
            f"prefill seq={length}", 0, length, time_prefill(contenders, tokens, length, settings)
        )
        for length in lengths
    ]
    decode = [
        _call(
            f"decode pos={fill}",
            fill,
            1,
            time_decode(contenders, tokens, fill, lengths[-1], settings),
        )
        for fill in fills
    ]
    return Benchmark(threads, eager.device if eager else None, (), tuple(prefill), tuple(decode))


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


def _loaded(artifact: Subject, eager: Subject | None, threads: int) -> list[Loaded]:
    """The artifact and eager (where there is a program to run) loaded, their kernels set to
    `threads` CPU threads."""
    for subject in (artifact, eager):
        if subject is not None:
            set_threads(subject.runtime, threads)
    loaded = [artifact.load()]
    if eager is None:
        log.info("[benchmark] no exported program to run in eager PyTorch: no speedup_vs_eager")
    else:
        loaded.append(eager.load())
    return loaded


def _speedup(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"
