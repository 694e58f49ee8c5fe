"""The cache builds an entry once, uses it while it matches its manifest, and rebuilds it when
it is partial or corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.cache.store import MANIFEST, Cache, key_of, link_files

MATERIAL = {"model": {"name": "mlp", "seed": 0}, "dynamic": {"batch": [1, 64]}}


class Builder:
    """Writes a program file and counts how often it was asked to."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, folder: Path) -> None:
        self.calls += 1
        (folder / "program.pt2").write_bytes(b"program" * 100)


def test_an_entry_is_built_once_and_then_hit(tmp_path: Path) -> None:
    cache, build = Cache(tmp_path), Builder()
    first, hit_first = cache.fetch("export", MATERIAL, build)
    second, hit_second = cache.fetch("export", dict(reversed(MATERIAL.items())), build)
    assert (hit_first, hit_second, build.calls) == (False, True, 1)
    assert first == second == tmp_path / "export" / key_of(MATERIAL)
    manifest = json.loads((first / MANIFEST).read_text())
    assert manifest["files"]["program.pt2"]["bytes"] == 700


def test_other_material_is_another_entry(tmp_path: Path) -> None:
    cache, build = Cache(tmp_path), Builder()
    cache.fetch("export", MATERIAL, build)
    _, hit = cache.fetch("export", {**MATERIAL, "dynamic": {"batch": [1, 32]}}, build)
    assert (hit, build.calls) == (False, 2)


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: (entry / "program.pt2").write_bytes(b"program" * 99 + b"progrxm"),
        lambda entry: (entry / "program.pt2").write_bytes(b"prog"),
        lambda entry: (entry / MANIFEST).unlink(),
        lambda entry: (entry / MANIFEST).write_text("{"),
        lambda entry: (entry / "program.pt2").unlink(),
        lambda entry: (entry / "stray.bin").write_bytes(b"x"),
    ],
    ids=["flipped-byte", "truncated", "no-manifest", "bad-manifest", "file-gone", "stray-file"],
)
def test_a_damaged_entry_is_rebuilt_never_used(tmp_path: Path, damage) -> None:
    cache, build = Cache(tmp_path), Builder()
    entry, _ = cache.fetch("export", MATERIAL, build)
    damage(entry)
    rebuilt, hit = cache.fetch("export", MATERIAL, build)
    assert (hit, build.calls) == (False, 2)
    assert (rebuilt / "program.pt2").read_bytes() == b"program" * 100
    assert cache.fetch("export", MATERIAL, build)[1]


def test_a_failed_build_leaves_no_entry_and_no_staging(tmp_path: Path) -> None:
    def fail(folder: Path) -> None:
        (folder / "program.pt2").write_bytes(b"half")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        Cache(tmp_path).fetch("export", MATERIAL, fail)
    assert list((tmp_path / "export").iterdir()) == []


def test_linked_files_leave_the_manifest_behind(tmp_path: Path) -> None:
    entry, _ = Cache(tmp_path / "cache").fetch("export", MATERIAL, Builder())
    placed = link_files(entry, tmp_path / "run")
    assert [path.name for path in placed] == ["program.pt2"]
    assert placed[0].read_bytes() == b"program" * 100
