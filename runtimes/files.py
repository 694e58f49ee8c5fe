"""Atomic file writes that follow the umask: a reader sees the old file or the whole new one,
never half of it, and the new one has the mode any file this process creates would have. A
write that finds its filesystem full (or the user's quota spent) is raised as NoRoom, naming
what was being written, once what it wrote is gone."""

from __future__ import annotations

import errno
import os
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What starts the name of a file or folder being written; a writer killed mid-write leaves it.
PARTIAL_PREFIX = ".partial-"
# A write's errors for want of room: the filesystem is full, or the user's quota is spent.
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoRoom(OSError):
    """A write that found no room on its filesystem: `what` was being written (`the bundle`),
    at the path `filename` names."""

    def __init__(self, error_number: int, what: str, path: Path) -> None:
        super().__init__(error_number, os.strerror(error_number), str(path))
        self.what = what


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then the error it was raised from or while handling, and so on."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        yield found
        found = found.__cause__ or found.__context__


def no_room_error(error: BaseException) -> OSError | None:
    """The OSError for want of room (ENOSPC, EDQUOT) in `error`'s chain; None where there is
    none."""
    for found in error_chain(error):
        if isinstance(found, OSError) and found.errno in NO_ROOM_ERRNOS:
            return found
    return None


def written_path(error: OSError) -> Path | None:
    """The path an OSError names as the one written: a copy's or rename's destination."""
    named = error.filename2 or error.filename
    return Path(named) if isinstance(named, str | os.PathLike) else None


def write_refused(folder: Path) -> int | None:
    """ENOSPC or EDQUOT where writing a block into `folder` finds no room, else None."""
    try:
        # Closed before the answer: a network filesystem (NFS) reports a full disk there.
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(bytes(os.statvfs(folder).f_bsize))
    except OSError as error:
        return error.errno if error.errno in NO_ROOM_ERRNOS else None
    return None


def nearest_folder(path: Path) -> Path:
    """The folder nearest to `path` that exists (itself where it is one): where a write to it
    takes room."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


@contextmanager
def room_checked(what: str, path: Path) -> Iterator[None]:
    """Raises NoRoom naming `what` and `path` where the block fails for want of room on the
    filesystem of `path` (a file or folder the block writes), or naming the file it wrote
    elsewhere (a toolchain's temporary files). Wrap the block inside its own cleanup: a native
    writer (torch.save's "iostream error") does not say why it failed, so the filesystem is
    tried while the partial file still takes its room."""
    try:
        yield
    except Exception as error:
        found = no_room_error(error)
        number = write_refused(nearest_folder(path)) if found is None else found.errno
        if number is None:
            raise
        # The failed writer's frames let go of what they hold: a native writer's file, open
        # there (torch.save's), would keep its room after the cleanup unlinks it.
        for failed in error_chain(error):
            traceback.clear_frames(failed.__traceback__)
        elsewhere = None if found is None else written_path(found)
        if elsewhere is not None and not _same_filesystem(elsewhere, path):
            raise NoRoom(number, "a file", elsewhere) from error
        raise NoRoom(number, what, path) from error


def _same_filesystem(one: Path, other: Path) -> bool:
    return os.stat(nearest_folder(one)).st_dev == os.stat(nearest_folder(other)).st_dev


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
def atomic_path(destination: Path, what: str = "the file") -> Iterator[Path]:
    """Yields a temporary path beside `destination`; renames it into place if the block succeeds.
    NoRoom, naming `what`, where the filesystem is full."""
    temporary = None
    try:
        with room_checked(what, destination):
            destination.parent.mkdir(parents=True, exist_ok=True)
            # The temporary name keeps the destination's suffix: some writers check it
            # (torch.export.save).
            handle, temporary = tempfile.mkstemp(
                dir=destination.parent, prefix=PARTIAL_PREFIX, suffix=f"-{destination.name}"
            )
            os.close(handle)
            # Before the writer: one that replaces the file (torch.export.save) makes it anew,
            # with the umask's mode already; one that writes into it keeps this one.
            yield follow_umask(Path(temporary))
            os.replace(temporary, destination)
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
