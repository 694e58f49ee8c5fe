"""Work done once: folders of files keyed by a hash of everything that determines them.

An entry is `<root>/<kind>/<key>/` with a `manifest.json`, written last, that records the key's
material and each file's size and SHA-256. An entry is used only when its manifest matches its
files; a partial or corrupt one is removed and rebuilt. Entries are built in a staging folder
and renamed into place, so parallel jobs never see half an entry, and when two build the same
one, the first rename wins and the other's copy is dropped. A staging folder is named after the
process that builds it: one whose process is gone (killed mid-build) is removed by the next
build of its kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtimes.files import atomic_path, follow_umask, room_checked

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


def key_of(material: Mapping[str, Any]) -> str:
    """The hash of the material, independent of key order."""
    canonical = json.dumps(material, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


class Cache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def fetch(
        self, kind: str, material: Mapping[str, Any], build: Callable[[Path], object]
    ) -> tuple[Path, bool]:
        """The entry's folder and whether it was a hit; on a miss `build(folder)` fills it."""
        entry = self.root / kind / key_of(material)
        if entry.exists():
            problem = _problem(entry)
            if problem is None:
                log.info("[cache] hit: %s %s", kind, entry)
                return entry, True
            log.warning("[cache] %s entry %s is unusable (%s); rebuilding it", kind, entry, problem)
            shutil.rmtree(entry, ignore_errors=True)
        staging = None
        try:
            # Inside the cleanup: a full filesystem is told apart while the partial entry is
            # still there.
            with room_checked(_entry_of(kind), entry):
                entry.parent.mkdir(parents=True, exist_ok=True)
                _remove_orphans(entry.parent)
                staging = Path(
                    tempfile.mkdtemp(dir=entry.parent, prefix=_staging_prefix(entry.name))
                )
                # Published as the entry: readable by whoever the umask lets read the cache.
                follow_umask(staging)
                build(staging)
                _write_manifest(staging, material)
                try:
                    staging.rename(entry)
                except OSError:
                    # Another job published the same entry first; theirs is as good as ours.
                    if _problem(entry) is not None:
                        raise
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        log.info("[cache] stored: %s %s", kind, entry)
        return entry, False

    def remove_staging_of(self, pid: int) -> None:
        """Removes the staging folders process `pid` of this host left (it died building)."""
        for kind in self.root.iterdir() if self.root.is_dir() else ():
            for staging in kind.glob(f".staging-*-{_owner(pid)}-*"):
                shutil.rmtree(staging, ignore_errors=True)


def _entry_of(kind: str) -> str:
    """What a full filesystem's message says was being written: `the goldens' cache entry`."""
    possessive = "'" if kind.endswith("s") else "'s"
    return f"the {kind}{possessive} cache entry"


def _staging_prefix(key: str) -> str:
    return f".staging-{key}-{_owner(os.getpid())}-"


def _owner(pid: int) -> str:
    # With the host: a cache on a shared file system has staging folders of other machines'
    # processes, whose liveness this one cannot judge.
    return f"pid{pid}@{socket.gethostname()}"


def _remove_orphans(kind_dir: Path) -> None:
    """Removes the staging folders of this host's processes that no longer run."""
    owned = re.compile(rf"-pid(\d+)@{re.escape(socket.gethostname())}-")
    for staging in kind_dir.glob(".staging-*"):
        match = owned.search(staging.name)
        if match and not _running(int(match[1])):
            shutil.rmtree(staging, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, alive
        pass
    return True


def link_files(entry: Path, out_dir: Path) -> list[Path]:
    """Puts the entry's files into `out_dir`, as hard links where the file system allows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    placed = []
    for source in sorted(entry.iterdir()):
        if source.name == MANIFEST:
            continue
        destination = out_dir / source.name
        destination.unlink(missing_ok=True)
        try:
            os.link(source, destination)
        except OSError:
            # Whole or not at all: a copy that finds the filesystem full leaves nothing.
            with atomic_path(destination, f"a copy of the cache's {source.name}") as temporary:
                shutil.copy2(source, temporary)
        placed.append(destination)
    return placed


def _write_manifest(folder: Path, material: Mapping[str, Any]) -> None:
    files = {
        path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.iterdir())
    }
    manifest = {"material": material, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))


def _problem(entry: Path) -> str | None:
    """Why the entry cannot be used, or None when every file matches its manifest."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        return f"no readable manifest: {error}"
    present = {path.name for path in entry.iterdir()} - {MANIFEST}
    if present != set(files):
        return f"files {sorted(present)} differ from the manifest's {sorted(files)}"
    for name, expected in files.items():
        path = entry / name
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()
