"""The job's log file, exporter.log in its run dir (conf/config.yaml's job_logging names this
handler): a line that its filesystem has no room for is lost to the file alone. The terminal
still shows it, and the job's next write to the run dir says that its filesystem is full
(exporter/errors.py's DiskFull); logging's own report would be a traceback for every line."""

from __future__ import annotations

import logging
import sys

from runtimes.files import no_room_error


class FileHandler(logging.FileHandler):
    """logging.FileHandler, quiet about the lines it has no room for."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if error is None or no_room_error(error) is None:
            super().handleError(record)
