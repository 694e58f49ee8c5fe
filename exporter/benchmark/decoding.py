"""The benchmark of a model with a KV cache: prefill at several lengths from position 0, and a
decode step (one token) at several cache fills, the artifact beside eager running the same
cache at the model's dtype.

Each figure times one call repeated at the same positions: a prefill rewrites slots 0..S-1
with the same tokens, a decode step rewrites the slot at its position with the same token, so
every timed run sees the cache the first one saw. Before a fill is timed, each instance's cache
is filled up to it by a session of the goldens' tokens (a prefill, then one decode step per
slot) through runtimes' `Cache`, which refuses positions that do not follow on, so the entries
the step reads are a real session's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exporter.benchmark.timing import Timing, measure, speedup
from exporter.config import BenchmarkConfig
from exporter.process import interrupts
from runtimes import Loaded
from runtimes.verdict.sessions import Cache

__all__ = ["CallLatency", "decode_fills", "time_decode", "time_prefill"]


@dataclass(frozen=True)
class CallLatency:
    """One call of a session timed: `tokens` tokens from `position` (a prefill from 0, or a
    decode step of one token at a cache fill of `position` slots)."""

    position: int
    tokens: int
    artifact: Timing
    eager: Timing | None

    @property
    def speedup_vs_eager(self) -> float | None:
        return speedup(self.artifact, self.eager)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens * 1e3 / self.artifact.median_ms

    @property
    def eager_tokens_per_s(self) -> float | None:
        return None if self.eager is None else self.tokens * 1e3 / self.eager.median_ms

    def to_json(self) -> dict[str, object]:
        return {
            "position": self.position,
            "tokens": self.tokens,
            **self.artifact.to_json(),
            "tokens_per_s": self.tokens_per_s,
            "eager": self.eager.to_json() if self.eager else None,
            "eager_tokens_per_s": self.eager_tokens_per_s,
            "speedup_vs_eager": self.speedup_vs_eager,
        }


def decode_fills(first: int, slots: int) -> list[int]:
    """The cache fills a decode step is timed at: the first decode step after the shortest
    prefill, half the cache and its last slot."""
    return sorted({first, max(first, slots // 2), slots - 1})


def time_prefill(
    contenders: Sequence[Loaded], tokens: torch.Tensor, length: int, settings: BenchmarkConfig
) -> list[Timing]:
    """Each contender's prefill of `tokens`' first `length` from position 0."""
    interrupts.check()
    inputs = (tokens[:length].unsqueeze(0), torch.arange(length))
    return measure(contenders, inputs, settings.warmup, settings.repeats, settings.seconds)


def time_decode(
    contenders: Sequence[Loaded],
    tokens: torch.Tensor,
    position: int,
    longest_prefill: int,
    settings: BenchmarkConfig,
) -> list[Timing]:
    """Each contender's decode step at `position`, its cache filled with `tokens` before it by a
    prefill of at most `longest_prefill` tokens and decode steps after."""
    interrupts.check()
    slots = tokens.shape[0]
    for contender in contenders:
        cache = Cache(contender, slots)
        prefill = min(position, longest_prefill)
        cache.call(tokens[:prefill].unsqueeze(0), 0)
        for filled in range(prefill, position):
            cache.call(tokens[filled : filled + 1].unsqueeze(0), filled)
    inputs = (tokens[position : position + 1].unsqueeze(0), torch.arange(position, position + 1))
    return measure(contenders, inputs, settings.warmup, settings.repeats, settings.seconds)
