"""A bundle: what a target needs to validate an artifact without the model, its checkpoint or the
exporter. The job writes one into its run dir (`bundle/`); `python -m runtimes.check BUNDLE`
reads it on the target.

A bundle is a folder: the artifact's files (hard links to the job's, not copies), the goldens
file (runtimes/verdict/goldens.py: the planned inputs, the float64 oracle's outputs and eager's
error at the model's dtype), and `manifest.json`, written last, which says how to run and judge
them (the runtime and its device, the output names, the live shapes and the order of the
executions, or for a model with a KV cache its sessions, the rule and its tolerances), where
they came from (the job's MLflow run, host and libraries), and every file's size and SHA-256.
A causal LM with a KV cache also has what a runner generates text with (`python -m runtimes.run
BUNDLE generate`): what an LLM runner reads of its program, and where the model has one, its
tokenizer in `tokenizer/`; an image classifier, where its checkpoint has one, its image processor
and labels in `preprocessor/` (`classify`). Their files are listed in the manifest like the
others. Copy the folder whole; links are followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from runtimes.files import atomic_path, room_checked
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.shapes import LiveShape
from runtimes.verdict.stats import Tolerances

MANIFEST = "manifest.json"
# The manifest's layout; a reader refuses another, naming both. 2: executions name their
# instance "same instance" or "new instance" (1: "reused" or "fresh"). 3: a model with a KV
# cache, whose goldens' sessions run in order on one instance (runtimes/verdict/sessions.py):
# a check that reads format 2 only would run their judged steps as separate calls, so it must
# refuse them. A bundle without sessions stays format 2, which every check reads. A causal LM's
# runner metadata and tokenizer/ bumped neither: a reader of either format ignores a key it does
# not know, and verifies the tokenizer's files by their paths as it does every file it lists.
FORMAT, SESSIONS_FORMAT = 2, 3
# The folders of the model's tokenizer and of its preprocessor (an image classifier's image
# processor and labels) in a bundle.
TOKENIZER_DIR, PREPROCESSOR_DIR = "tokenizer", "preprocessor"


class BundleInvalid(Exception):
    """The bundle cannot be checked: a file is missing, unreadable, or not what was written."""


@dataclass(frozen=True)
class Bundle:
    folder: Path
    # The runtime module of this package that loads the artifact, and the device it ran on.
    runtime: str
    device: str
    # The artifact's file name in the folder; a data file it needs (a .ptd) lies beside it.
    artifact: str
    output_names: tuple[str, ...]
    # The live shapes, smallest first, and every execution in order with the instance that
    # runs it (runtimes/verdict/shapes.py).
    shapes: tuple[LiveShape, ...]
    executions: tuple[tuple[LiveShape, str], ...]
    tolerances: Tolerances
    # Where the bundle came from: the job's MLflow run (run_id, tracking_uri, experiment; None
    # where tracking was off), its run dir, host, choices and library versions.
    source: Mapping[str, Any]
    # File path in the folder (`tokenizer/tokenizer.json`) -> {"bytes": size, "sha256": digest}.
    files: Mapping[str, Mapping[str, Any]]
    # A model with a KV cache: per session, its prefill, its steps and the positions judged
    # (runtimes/verdict/sessions.py `outline`); the goldens hold the sessions themselves.
    sessions: tuple[Mapping[str, Any], ...] = ()
    # A causal LM with a KV cache: what an LLM runner reads of its program, under the names of
    # ExecuTorch's runners (`get_max_context_len`, the cache's slots; `get_max_seq_len`, the
    # longest call; `get_vocab_size`; `get_eos_ids` where the checkpoint names them); else empty.
    runner_metadata: Mapping[str, Any] = field(default_factory=dict)
    # The folder of the model's tokenizer (its save_pretrained files), where it has one.
    tokenizer: str | None = None
    # The folder of the model's preprocessor, where it has one.
    preprocessor: str | None = None

    @property
    def artifact_path(self) -> Path:
        return self.folder / self.artifact

    def goldens(self) -> stored_goldens.Goldens:
        try:
            return stored_goldens.load(self.folder)
        except Exception as error:
            raise BundleInvalid(
                f"{self.folder / stored_goldens.GOLDENS_FILE}: cannot be read: "
                f"{type(error).__name__}: {error}"
            ) from error

    @property
    def total_bytes(self) -> int:
        return sum(entry["bytes"] for entry in self.files.values())

    def load_failure(self, device: str, error: Exception) -> str:
        """Why the artifact's runtime could not load it on `device`, and which torch built it
        where that is not this one's (a program of another torch may not load)."""
        message = (
            f"cannot load {self.artifact_path} (runtime {self.runtime}) on {device}: "
            f"{type(error).__name__}: {error}"
        )
        built_with = self.source.get("libraries", {}).get("torch")
        here = versions(("torch",)).get("torch")
        if built_with and built_with != here:
            message += f" (the artifact was built with torch {built_with}; this is torch {here})"
        return message


def write(
    folder: Path,
    artifact_files: Sequence[Path],
    goldens: stored_goldens.Goldens | Path,
    runtime: str,
    device: str,
    output_names: Sequence[str],
    shapes: Sequence[LiveShape],
    executions: Sequence[tuple[LiveShape, str]],
    tolerances: Tolerances,
    source: Mapping[str, Any],
    sessions: Sequence[Mapping[str, Any]] = (),
    runner_metadata: Mapping[str, Any] | None = None,
    save_tokenizer: Callable[[Path], object] | None = None,
    save_preprocessor: Callable[[Path], object] | None = None,
) -> Bundle:
    """Writes the bundle into `folder` (made or emptied): `artifact_files` first (the artifact,
    then its data file), `goldens` linked where it is a file, saved where it is in memory, the
    tokenizer and the preprocessor where `save_tokenizer` and `save_preprocessor` write them into
    the folder each is given (their save_pretrained), and the manifest last, so a bundle whose
    writing stopped has none and is refused. One that fails is removed, NoRoom naming it where
    its filesystem is full. `sessions` and `runner_metadata`: a model with a KV cache's, as
    `Bundle` says."""
    try:
        with room_checked("the bundle", folder):
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.iterdir():
                # The tokenizer's and preprocessor's folders, from a bundle the repair stage
                # writes again.
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
            placed = [_link(path, folder) for path in artifact_files]
            if isinstance(goldens, Path):
                placed.append(_link(goldens, folder))
            else:
                placed.append(stored_goldens.save(goldens, folder))
            saved = {}
            for name, save in (
                (TOKENIZER_DIR, save_tokenizer),
                (PREPROCESSOR_DIR, save_preprocessor),
            ):
                if save is not None:
                    save(folder / name)
                    placed.extend(sorted(p for p in (folder / name).rglob("*") if p.is_file()))
                    saved[name] = name
            bundle = Bundle(
                folder=folder,
                runtime=runtime,
                device=device,
                artifact=placed[0].name,
                output_names=tuple(output_names),
                shapes=tuple(shapes),
                executions=tuple(executions),
                tolerances=tolerances,
                source=dict(source),
                files={
                    path.relative_to(folder).as_posix(): {
                        "bytes": path.stat().st_size,
                        "sha256": sha256(path),
                    }
                    for path in placed
                },
                sessions=tuple(sessions),
                runner_metadata=dict(runner_metadata or {}),
                tokenizer=saved.get(TOKENIZER_DIR),
                preprocessor=saved.get(PREPROCESSOR_DIR),
            )
            manifest = {"format": SESSIONS_FORMAT if sessions else FORMAT} | {
                f.name: getattr(bundle, f.name) for f in fields(Bundle) if f.name != "folder"
            }
            manifest["tolerances"] = asdict(tolerances)
            with atomic_path(folder / MANIFEST) as temporary:
                temporary.write_text(json.dumps(manifest, indent=2))
            return bundle
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def read(folder: Path) -> Bundle:
    """The bundle in `folder`, once every file it lists is there with its size and SHA-256;
    raises BundleInvalid naming the first file that is not."""
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleInvalid(
            f"{path}: no such file. A bundle is the bundle/ folder of a job's run dir, copied "
            "whole; one without its manifest was not written to the end."
        )
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") not in (FORMAT, SESSIONS_FORMAT):
            raise BundleInvalid(
                f"{path}: bundle format {manifest.get('format')!r}; this check reads formats "
                f"{FORMAT} and {SESSIONS_FORMAT}. Check it with the runtimes package of the "
                "exporter that wrote it."
            )
        bundle = Bundle(
            folder=folder,
            runtime=manifest["runtime"],
            device=manifest["device"],
            artifact=manifest["artifact"],
            output_names=tuple(manifest["output_names"]),
            shapes=tuple(manifest["shapes"]),
            executions=tuple((shape, instance) for shape, instance in manifest["executions"]),
            tolerances=Tolerances(**manifest["tolerances"]),
            source=manifest["source"],
            files=manifest["files"],
            sessions=tuple(manifest.get("sessions", ())),
            runner_metadata=manifest.get("runner_metadata", {}),
            tokenizer=manifest.get("tokenizer"),
            preprocessor=manifest.get("preprocessor"),
        )
    except BundleInvalid:
        raise
    except (ValueError, KeyError, TypeError) as error:
        raise BundleInvalid(f"{path}: unreadable: {type(error).__name__}: {error}") from error
    for name, entry in bundle.files.items():
        _verify(folder / name, entry)
    return bundle


def versions(distributions: Sequence[str]) -> dict[str, str]:
    """The installed version of each of `distributions` that is installed: where a bundle was
    written, and where it is checked."""
    found = {}
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _verify(path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file():
        raise BundleInvalid(
            f"{path}: no such file; the bundle's manifest lists it ({entry['bytes']} bytes). "
            "Copy the bundle folder whole."
        )
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise BundleInvalid(
            f"{path}: {size} bytes where the bundle's manifest says {entry['bytes']}: the file "
            "changed after the bundle was written, or was copied in part."
        )
    if sha256(path) != entry["sha256"]:
        raise BundleInvalid(
            f"{path}: its SHA-256 does not match the bundle's manifest: the file changed after "
            "the bundle was written."
        )


def _link(path: Path, folder: Path) -> Path:
    """`path` in `folder` under its own name: a hard link, or where the file lies on another
    file system, a symbolic link to it (copying the bundle with links followed takes the file)."""
    destination = folder / path.name
    try:
        os.link(path, destination)
    except OSError:
        destination.symlink_to(path.resolve())
    return destination
