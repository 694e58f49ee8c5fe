"""A long stage says how long it has run and what it does, a line per period, and stops saying
it when it ends."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from exporter.job.timing import stage
from exporter.process import progress
from exporter.tracking.record import JobRecord


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.__name__]


def test_a_long_stage_logs_its_time_and_activity_each_period_until_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    with progress.reported("lower", period_s=0.1):
        time.sleep(0.35)
        progress.doing("partitioning for XNNPACK")
        time.sleep(0.35)
    lines = progress_lines(caplog)
    plain = [line for line in lines if re.fullmatch(r"\[lower\] running for \d+ s", line)]
    doing = [line for line in lines if line.endswith(" s: partitioning for XNNPACK")]
    # In order: what it did before it said, then what it said.
    assert plain and doing and lines == plain + doing
    ended = len(lines)
    time.sleep(0.3)
    assert len(progress_lines(caplog)) == ended


def test_a_stage_shorter_than_the_period_says_nothing_and_doing_outside_one_is_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    progress.doing("nothing runs")
    with progress.reported("validate", period_s=10):
        progress.doing("judging")
    assert progress_lines(caplog) == []


def test_every_stage_of_a_job_reports_its_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(progress, "PERIOD_S", 0.1)
    with stage(JobRecord(run_dir=tmp_path), "lower", lambda kind, value: None):
        progress.doing("partitioning for XNNPACK")
        time.sleep(0.35)
    lines = progress_lines(caplog)
    assert lines and all(line.endswith(" s: partitioning for XNNPACK") for line in lines)
