"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yields a temporary path beside `destination`; renames it into place if the block succeeds."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name keeps the destination's suffix: some writers check it (torch.export.save).
    handle, temporary = tempfile.mkstemp(
        dir=destination.parent, prefix=".partial-", suffix=f"-{destination.name}"
    )
    os.close(handle)
    try:
        yield Path(temporary)
        os.replace(temporary, destination)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def write_bytes(destination: Path, data: bytes) -> Path:
    with atomic_path(destination) as temporary:
        temporary.write_bytes(data)
    return destination


def write_json(destination: Path, payload: Any) -> Path:
    return write_bytes(destination, (json.dumps(payload, indent=2) + "\n").encode())
