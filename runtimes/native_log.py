"""Native libraries' own lines go to a file, not the terminal.

ExecuTorch's C++ runtime (`[cpuinfo_utils.cpp:71] Reading file ...`, `[threadpool.cpp:66]
Resetting threadpool ...`), its kernels and a crash's last words write to file descriptor 2
directly, below Python's logging, so no logging setting reaches them. `to_file` points that
descriptor at a file; Python's own stderr (a traceback, a progress bar) keeps writing where it
wrote before. Python's fault handler writes there too: a segfault's Python stack is in that
file, after whatever the native code said before it died.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

NATIVE_LOG = "native.log"
# How Python's fault handler starts what it writes on a crash.
_FAULT_HANDLER = "Fatal Python error"


def to_file(path: Path) -> None:
    """From now on, what native code writes to stderr is appended to `path`."""
    sys.stderr.flush()
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(
        terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors
    )
    faulthandler.enable(file=2)


def last_words(path: Path, lines: int) -> str:
    """What a crashed process wrote last to `path`: from the fault handler's `Fatal Python
    error` line where there is one (its stack follows, innermost call first), else the file's
    end; at most `lines` lines."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} is missing)"
    start = text.rfind(_FAULT_HANDLER)
    found = text[start:].splitlines()[:lines] if start >= 0 else text.splitlines()[-lines:]
    return "\n".join(found) or f"({path} is empty)"
