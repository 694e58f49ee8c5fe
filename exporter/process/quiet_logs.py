"""Loggers raised to a level for the length of a block: for steps whose INFO (or WARNING) lines
repeat what the job says once in its own words."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def quieted(names: Sequence[str], level: int) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, levels, strict=True):
            logger.setLevel(previous)
