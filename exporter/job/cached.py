"""Where a job's cached stages (plan, export, goldens, lower) get what they make: the cache's
entry for their inputs, made only where no job made it before, or with the cache off, a folder
of the run dir's or the value alone. The job's record learns each stage's cache key and whether
the cache had its work here, and nowhere else."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from exporter.cache.store import Cache, key_of
from exporter.tracking.record import CacheUse
from runtimes.files import PARTIAL_PREFIX, room_checked

Value = TypeVar("Value")


@dataclass(frozen=True)
class CachedWork:
    """The cache (None where it is off), the run dir (where, with the cache off, files are
    staged) and the record's ledger of keys and hits."""

    cache: Cache | None
    run_dir: Path
    use: CacheUse

    @contextlib.contextmanager
    def built(
        self, kind: str, material: dict[str, Any], build: Callable[[Path], object]
    ) -> Iterator[Path]:
        """Yields the folder holding the files `build(folder)` writes: the cache's entry for
        `material`, built only if no job built it before, or with the cache off, a folder of
        its own in the run dir, removed on exit. The caller links what it accepts into the run
        dir."""
        self.use.keys[kind] = key_of(material)
        if self.cache is not None:
            entry, self.use.hits[kind] = self.cache.fetch(kind, material, build)
            yield entry
            return
        folder = Path(tempfile.mkdtemp(dir=self.run_dir, prefix=PARTIAL_PREFIX))
        try:
            with room_checked(f"the {kind} stage's files", folder):
                build(folder)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def kept(
        self,
        kind: str,
        material: dict[str, Any],
        compute: Callable[[], Value],
        save: Callable[[Value, Path], object],
        load: Callable[[Path], Value],
    ) -> tuple[Value, Path | None]:
        """The value `compute()` makes, and the cache's entry holding it: loaded from the entry
        for `material` where a job made it before, else computed and saved there; with the cache
        off, computed and held in memory only (no entry): a value that is no result of the job
        is not written into its run dir."""
        self.use.keys[kind] = key_of(material)
        if self.cache is None:
            return compute(), None
        entry, self.use.hits[kind] = self.cache.fetch(
            kind, material, lambda out: save(compute(), out)
        )
        return load(entry), entry
