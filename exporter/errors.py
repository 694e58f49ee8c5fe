"""Errors a job can end with: each names its stage and carries the exit code DESIGN.md assigns."""

from __future__ import annotations


class ExporterError(Exception):
    """A failure the user can act on; its message says what went wrong and what to do."""

    stage: str = "job"
    exit_code: int = 1


class ValidationFailed(ExporterError):
    stage = "validate"
    exit_code = 1


class ConfigError(ExporterError):
    stage = "config"
    exit_code = 2


class ExportFailed(ExporterError):
    stage = "export"
    exit_code = 3


class LoweringFailed(ExporterError):
    stage = "lower"
    exit_code = 4


class RuntimeFailed(ExporterError):
    stage = "runtime"
    exit_code = 5


class TrackingFailed(ExporterError):
    """The MLflow store could not be written; a configuration problem in every case seen so far."""

    stage = "track"
    exit_code = 2
