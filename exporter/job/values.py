"""The values a job's stages hand each other, beyond the model's bundle: the exported program's
file (export), what every artifact is judged against (goldens), the artifact with the weights
its audit checks (lower), and what a target generates text with beside a causal LM's artifact
(model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exporter import export, models, validate
from exporter.artifact import Artifact
from exporter.export import Exported
from exporter.process import progress
from runtimes.verdict import goldens as stored_goldens
from runtimes.verdict.shapes import LiveShape


@dataclass(frozen=True)
class ProgramFile:
    """The export stage's value: the folder holding program.pt2 (the cache's entry, or with the
    cache off the run dir), what loading it needs of the model, the cache material that made it
    (lowering's key builds on it), and why torch.export failed where the job went on with
    draft_export's program. Stages load the program from it once the model has gone, with
    weights of its own: no stage holds both."""

    folder: Path
    profiles: tuple[export.shapes.InputProfile, ...]
    material: dict[str, Any]
    diagnosis: export.Diagnosis | None
    # What an LLM runner reads of the artifact, which lowering writes into it.
    runner_metadata: models.RunnerMetadata
    # The program's buffers that it writes as it runs (a KV cache), which the weights audit
    # skips.
    state: frozenset[str] = frozenset()

    @property
    def path(self) -> Path:
        return self.folder / export.PROGRAM_FILE

    def load(self) -> Exported:
        progress.doing("loading the exported program")
        return export.load(self.folder, self.profiles, self.runner_metadata)


@dataclass(frozen=True)
class Expected:
    """The goldens stage's value, what every artifact of the job is judged against: the model's
    output names, the live shapes, the goldens (the planned inputs, the float64 oracle's outputs
    and eager's error at the model's dtype) with the cache's file of them (None with the cache
    off), and the job's rule."""

    output_names: tuple[str, ...]
    shapes: list[LiveShape]
    goldens: stored_goldens.Goldens
    file: Path | None
    tolerances: validate.Tolerances

    @property
    def source(self) -> stored_goldens.Goldens | Path:
        """What a bundle takes the goldens from: the cache's file where there is one."""
        return self.file or self.goldens


@dataclass(frozen=True)
class Lowered:
    """The lower stage's value: the artifact in the run dir, and the weights the audit checks
    its constants against (the exported program's as the stage loaded it, or the model's for a
    given artifact), emptied by the audit, which runs before the artifact is loaded; `state`:
    those of them that the program writes as it runs (a KV cache), which the audit skips."""

    artifact: Artifact
    weights: dict[str, torch.Tensor]
    state: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Running:
    """What the model stage hands the bundle, once the model itself has gone: what a target
    runs the model with beside the artifact (`python -m runtimes.run`). A causal LM with a KV
    cache's `runner_metadata`, what an LLM runner reads of the program (the cache's slots, the
    longest call, the vocabulary, the EOS ids), and `tokenizer`, which loads the checkpoint's
    tokenizer (ConfigError where transformers cannot; None where the model has no checkpoint);
    an image classifier's `preprocessor`, which writes its image processor and labels into a
    folder. Empty for any other model."""

    runner_metadata: models.RunnerMetadata = field(default_factory=dict)
    tokenizer: Callable[[], Any] | None = None
    preprocessor: Callable[[Path], object] | None = None
