"""Golden outputs: the inputs of every planned live shape and eager float64 outputs for them."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from exporter.models import ModelBundle
from exporter.validate.plan import LiveShape, label

GOLDENS_FILE = "goldens.pt"

# Live shape label -> (inputs as the model sees them, float64 outputs as a flat list).
Goldens = dict[str, tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]]


def compute(bundle: ModelBundle, shapes: Sequence[LiveShape], seed: int) -> Goldens:
    oracle = copy.deepcopy(bundle.module).to(torch.float64)
    goldens: Goldens = {}
    for shape in shapes:
        key = label(shape)
        # Seeded by the shape itself, so adding a shape to the plan changes no other's inputs.
        inputs = bundle.make_inputs(shape, zlib.crc32(f"{seed}:{key}".encode()))
        wide = [t.to(torch.float64) if t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            goldens[key] = (inputs, pytree.tree_leaves(oracle(*wide)))
    return goldens


def save(goldens: Goldens, folder: Path) -> None:
    torch.save(goldens, folder / GOLDENS_FILE)


def load(folder: Path) -> Goldens:
    return torch.load(folder / GOLDENS_FILE, weights_only=True)
