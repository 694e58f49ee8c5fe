"""Atomic file writes: a reader sees the old file or the whole new one, never half of it, and
the file's mode follows the umask (runtimes/files.py, which a target's check uses too). One that
finds its filesystem full leaves nothing and raises NoRoom, naming `what` it was writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtimes.files import atomic_path

__all__ = ["atomic_path", "write_bytes", "write_json"]


def write_bytes(destination: Path, data: bytes, what: str = "the file") -> Path:
    with atomic_path(destination, what) as temporary:
        temporary.write_bytes(data)
    return destination


def write_json(destination: Path, payload: Any, what: str = "the file") -> Path:
    return write_bytes(destination, (json.dumps(payload, indent=2) + "\n").encode(), what)
