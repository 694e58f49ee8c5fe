"""Reading what a backend's toolchain logs at DEBUG while it partitions: XNNPACK's reasons for
refusing nodes, which belong in the partition report, not in the job's log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def captured(logger_name: str, receive: Callable[[logging.LogRecord], None]) -> Iterator[None]:
    """Hands every record the logger emits, DEBUG included, to `receive` while the block runs,
    and keeps them out of the job's log."""
    logger = logging.getLogger(logger_name)

    class Receiver(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            receive(record)

    handler = Receiver(logging.DEBUG)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
