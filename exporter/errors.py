"""Errors a job can end with: each names its stage and carries the exit code DESIGN.md assigns,
so a failure is reported by where it happened, not by what happened to be running around it."""

from __future__ import annotations

import shutil
import sys
from typing import NoReturn

from runtimes.files import NoRoom, nearest_folder, no_room_error, written_path


class ExporterError(Exception):
    """A failure the user can act on; its message says what went wrong and what to do."""

    stage: str = "job"
    exit_code: int = 1


class ValidationFailed(ExporterError):
    stage = "validate"
    exit_code = 1


class QualityFailed(ValidationFailed):
    """A quantized artifact computes what the quantized model computes (fidelity passed), and
    quantization costs more than quantize.budget allows."""


class ConfigError(ExporterError):
    stage = "config"
    exit_code = 2


class TrackingUnavailable(ConfigError):
    """The MLflow store that mlflow.tracking_uri names cannot be opened or reached: found before
    any work, and fixed in the configuration (or by starting the server)."""

    stage = "track"


class StartupFailed(ConfigError):
    """The job's libraries could not be loaded: this machine's setup, found before any work."""

    stage = "startup"


class DiskFull(ConfigError):
    """A write of the job found its filesystem full, or the user's quota spent. Where a job
    writes is its configuration's to choose: a place it cannot write is refused before any work
    (exporter/job/outputs.py, exit 2), and one found full during the job ends it with the same
    code, not the code of the stage that happened to be writing (the model did not fail)."""

    def __init__(self, no_room: OSError, stage: str) -> None:
        """`no_room`: the write's error (NoRoom names what was being written); `stage`: where
        the job was. The free space is measured now, once the partial files are removed."""
        what = no_room.what if isinstance(no_room, NoRoom) else "a file"
        path = written_path(no_room)
        if path is None:
            where = f"writing {what} (its path unknown)"
        else:
            usage = shutil.disk_usage(nearest_folder(path))
            free = f"{_size(usage.free)} free of {_size(usage.total)} there"
            where = f"writing {what} {path}: {free}"
        super().__init__(
            f"{no_room.strerror} {where}; free some space, or move the job's outputs "
            "(hydra.run.dir=DIR, cache_dir=DIR, mlflow.tracking_uri=URI)."
        )
        self.stage = stage


def disk_full(error: BaseException, stage: str) -> DiskFull | None:
    """The DiskFull that `error` amounts to where a write in it found no room (an OSError it is
    or came from, ENOSPC or EDQUOT), raised in `stage`; None otherwise."""
    if isinstance(error, DiskFull):
        return error
    found = no_room_error(error)
    return None if found is None else DiskFull(found, stage)


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


class ExportFailed(ExporterError):
    stage = "export"
    exit_code = 3


class LoweringFailed(ExporterError):
    stage = "lower"
    exit_code = 4


class RuntimeFailed(ExporterError):
    """The artifact's runtime could not load or run it."""

    stage = "runtime"
    exit_code = 5


class ModelFailed(ExporterError):
    """The model itself failed in eager PyTorch, before any artifact was judged: building it."""

    stage = "model"
    exit_code = 6


class GoldensFailed(ModelFailed):
    """The float64 oracle could not run the model on a planned input."""

    stage = "goldens"


class QuantizeFailed(ModelFailed):
    """torchao could not quantize the model as the quantize config asks."""

    stage = "quantize"


class TrackingFailed(ExporterError):
    """The job ran, but its MLflow run could not be written; the run dir holds its results."""

    stage = "track"
    exit_code = 7


def stop_before_any_job(error: ExporterError) -> NoReturn:
    """Ends the command for an error found before any job started, as Hydra ends it for a
    config it cannot compose: the message on stderr, no traceback, the error's exit code."""
    print(f"[{error.stage}] {error}", file=sys.stderr)
    raise SystemExit(error.exit_code)


# The error an unexpected exception (or a crash of the job's process) in each stage becomes.
STAGE_ERRORS: dict[str, type[ExporterError]] = {
    "config": ConfigError,
    # Opening the MLflow run and loading the stages' libraries (torch, the backend's).
    "startup": StartupFailed,
    "model": ModelFailed,
    "quantize": QuantizeFailed,
    "export": ExportFailed,
    "lower": LoweringFailed,
    # Writing the artifact's bundle for a target: part of what lowering delivers.
    "bundle": LoweringFailed,
    "goldens": GoldensFailed,
    "validate": RuntimeFailed,
    # The search reports its own failures; what escapes it is a bug in it, not in the artifact.
    "localize": ValidationFailed,
    # Lowering again with an op kept out of the delegate, then validating that artifact.
    "repair": LoweringFailed,
    "benchmark": RuntimeFailed,
    "track": TrackingFailed,
}
