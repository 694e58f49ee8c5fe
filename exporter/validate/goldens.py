"""Golden outputs: the inputs of every planned live shape and eager float64 outputs for them,
and the dtype of each output of eager at the model's own dtype, which the artifact must match."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from exporter.errors import GoldensFailed
from exporter.models import ModelBundle
from exporter.validate.plan import LiveShape, label

GOLDENS_FILE = "goldens.pt"


@dataclass(frozen=True)
class Goldens:
    # Live shape label -> (inputs as the model sees them, float64 outputs as a flat list).
    cases: dict[str, tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]]
    # Per output, flat as the cases' outputs: its dtype from the module as built. The float64
    # oracle cannot say it, and a runtime that returns another dtype is wrong however close.
    output_dtypes: tuple[torch.dtype, ...]


def compute(bundle: ModelBundle, shapes: Sequence[LiveShape], seed: int) -> Goldens:
    oracle = copy.deepcopy(bundle.module).to(torch.float64)
    cases = {}
    for shape in shapes:
        key = label(shape)
        # Seeded by the shape itself, so adding a shape to the plan changes no other's inputs.
        inputs = bundle.make_inputs(shape, zlib.crc32(f"{seed}:{key}".encode()))
        wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]
        try:
            with torch.no_grad():
                cases[key] = (inputs, pytree.tree_leaves(oracle(*wide)))
        except Exception as error:
            raise GoldensFailed(
                f"the float64 oracle (the eager model in float64) could not run at {key}: "
                f"{type(error).__name__}: {error}. No artifact was judged; the model must run "
                "in float64 for its outputs to be checked."
            ) from error
    # The dtypes do not depend on the sizes: one run at the smallest shape, the cheapest, says.
    smallest_inputs, _ = cases[label(shapes[0])]
    with torch.no_grad():
        outputs = pytree.tree_leaves(bundle.module(*smallest_inputs))
    return Goldens(cases, tuple(output.dtype for output in outputs))


def save(goldens: Goldens, folder: Path) -> None:
    # A plain dict: torch.load(weights_only=True) refuses classes it does not know, dtypes it
    # loads.
    torch.save(vars(goldens), folder / GOLDENS_FILE)


def load(folder: Path) -> Goldens:
    return Goldens(**torch.load(folder / GOLDENS_FILE, weights_only=True))
