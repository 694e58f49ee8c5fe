"""A long stage says how long it has run and what it is doing, so that a minute of lowering (or
of an AOTInductor compile, or a 1B model's export) is not a minute of silence.

Every stage runs under `reported` (exporter/job/timing.py's `stage`): from PERIOD_S seconds on it
logs a line per period, with what the code inside said it does through `doing`. The lines go
through the job's log like the stage's others, to the terminal and exporter.log alike: one line
per period, nothing that redraws.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

# Seconds between two lines: a stage shorter than this says nothing more.
PERIOD_S = 10.0


class _Ticker:
    """The thread that writes a running stage's lines."""

    def __init__(self, stage: str, period_s: float) -> None:
        self.stage = stage
        self.period_s = period_s
        self.activity: str | None = None
        self.started = time.perf_counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._tick, name=f"progress-{stage}", daemon=True)

    def _tick(self) -> None:
        while not self.stopped.wait(self.period_s):
            elapsed = time.perf_counter() - self.started
            doing = f": {self.activity}" if self.activity else ""
            log.info("[%s] running for %.0f s%s", self.stage, elapsed, doing)


# The stage running now, whose lines `doing` feeds.
_running: _Ticker | None = None


@contextlib.contextmanager
def reported(stage: str, period_s: float = PERIOD_S) -> Iterator[None]:
    """Logs how long the block has run, every `period_s` seconds, until it ends."""
    global _running
    ticker, outer = _Ticker(stage, period_s), _running
    _running = ticker
    ticker.thread.start()
    try:
        yield
    finally:
        ticker.stopped.set()
        ticker.thread.join()
        _running = outer


def doing(activity: str) -> None:
    """Says what the running stage does now (`partitioning for XNNPACK`): its next line names
    it. Outside a stage it says nothing."""
    if _running is not None:
        _running.activity = activity
