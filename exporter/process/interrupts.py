"""Ctrl-C in a job's process, held until a point where stopping is safe.

Python raises KeyboardInterrupt wherever the interpreter is when SIGINT arrives. Inside a
callback that C++ code made into Python (ExecuTorch's partitioners, torch's dispatcher), the
exception cannot unwind through the C++ frames and the process aborts ("terminate called after
throwing an instance of 'python_error'"), leaving no record. So the first SIGINT only asks the
job to stop; the job raises KeyboardInterrupt itself at its next safe point (between stages,
between validation runs), where its record is written. A second SIGINT stops at once.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

_requested = False


def defer() -> None:
    """From now on, SIGINT asks the job to stop at its next safe point."""
    signal.signal(signal.SIGINT, _request)


def check() -> None:
    """A safe point: raises KeyboardInterrupt if a stop was asked for."""
    if _requested:
        raise KeyboardInterrupt


def _request(signum: int, frame: FrameType | None) -> None:
    global _requested
    if _requested:
        signal.default_int_handler(signum, frame)
    _requested = True
    log.warning("interrupted: the job stops when its current step returns (Ctrl-C again: now)")
