"""Atomic file writes that follow the umask: a reader sees the old file or the whole new one,
never half of it, and the new one has the mode any file this process creates would have."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What starts the name of a file or folder being written; a writer killed mid-write leaves it.
PARTIAL_PREFIX = ".partial-"


def umask() -> int:
    """The process's umask, read without changing it where Linux says it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere it is read by setting it: to a stricter mask, so that a file another thread
    # creates meanwhile is never more open than intended.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> Path:
    """Gives a file or folder that tempfile made private (0600, 0700) the mode the umask gives
    what open() and mkdir() create: 0644 and 0755 under umask 022."""
    full = 0o777 if path.is_dir() else 0o666
    path.chmod(full & ~umask())
    return path


@contextmanager
def atomic_path(destination: Path) -> Iterator[Path]:
    """Yields a temporary path beside `destination`; renames it into place if the block succeeds."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name keeps the destination's suffix: some writers check it (torch.export.save).
    handle, temporary = tempfile.mkstemp(
        dir=destination.parent, prefix=PARTIAL_PREFIX, suffix=f"-{destination.name}"
    )
    os.close(handle)
    try:
        # Before the writer: one that replaces the file (torch.export.save) makes it anew, with
        # the umask's mode already; one that writes into it keeps this one.
        yield follow_umask(Path(temporary))
        os.replace(temporary, destination)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
