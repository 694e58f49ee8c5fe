"""How a stage runs in the job's frame: timed, announced, its peak memory measured, and an
unexpected exception in it made the stage's own error."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from exporter.errors import STAGE_ERRORS, ExporterError, disk_full
from exporter.process import interrupts, memory, progress
from exporter.tracking.record import JobRecord

log = logging.getLogger(__name__)

# Tells the command's process how far the job got: ("run_id", id), ("stage", name).
Notify = Callable[[str, str], None]


@contextlib.contextmanager
def stage(record: JobRecord, name: str, notify: Notify) -> Iterator[None]:
    """Times and announces the stage, says how long it has run while it runs long
    (exporter/process/progress.py) and measures its peak RSS; an unexpected exception in it
    becomes the stage's ExporterError, and a write that found no room DiskFull. Its start and
    end are the points where a requested stop happens."""
    interrupts.check()
    record.stage = name
    notify("stage", name)
    log.info("[%s] started", name)
    # What ran since the last stage (opening the MLflow run) counts for the job's peak.
    _note_job_peak(record, memory.reset_peak())
    start = time.perf_counter()
    try:
        with progress.reported(name, progress.PERIOD_S):
            yield
    except Exception as error:
        if (full := disk_full(error, name)) is not None:
            # Its message says all there is to do; what was being written is removed.
            raise full from None
        if isinstance(error, ExporterError):
            raise
        raise STAGE_ERRORS[name](f"{type(error).__name__}: {error}") from error
    finally:
        record.seconds[name] = time.perf_counter() - start
        record.peak_rss_bytes[name] = memory.peak_rss()
        record.peak_rss_scope = memory.scope()
        _note_job_peak(record, record.peak_rss_bytes[name])
    log.info(
        "[%s] done in %.1f s, peak RSS %.2f GB",
        name,
        record.seconds[name],
        record.peak_rss_bytes[name] / memory.GB,
    )
    interrupts.check()


def _note_job_peak(record: JobRecord, peak: int) -> None:
    record.job_peak_rss_bytes = max(record.job_peak_rss_bytes or 0, peak)
