"""Native libraries' own lines go to a file, not the terminal.

ExecuTorch's C++ runtime logs (`[cpuinfo_utils.cpp:71] Reading file ...`, `[threadpool.cpp:66]
Resetting threadpool ...`) through its Python bindings to Python's stderr, other native code
(kernels, a crash's last words) to file descriptor 2 directly: below Python's logging, so no
logging setting reaches them. `routed_to` points that descriptor, which Python's stderr writes
to, at a file for the length of a block. The job's own lines go through its log to stdout; an
exception that leaves the block is printed where stderr wrote before. Python's fault handler
writes to the descriptor too: a segfault inside the block leaves its Python stack in the file,
after whatever the native code said before it died.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from collections.abc import Iterator
from pathlib import Path

NATIVE_LOG = "native.log"
# How Python's fault handler starts what it writes on a crash.
_FAULT_HANDLER = "Fatal Python error"


@contextlib.contextmanager
def routed_to(path: Path) -> Iterator[None]:
    """Inside, what is written to stderr (Python's or file descriptor 2) is appended to
    `path`."""
    sys.stderr.flush()
    before = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(before, 2)
        os.close(before)


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
