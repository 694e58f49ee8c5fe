"""Weights an artifact stores concatenated: a backend that computes several projections as one
(exporter/backends/common/fused_projections.py) stores one weight where the model has several,
and records what it holds, so the weights audit splits it and compares each part with its own
parameter. An AOTInductor package records it in its models' metadata under `FUSED_WEIGHTS`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

FUSED_WEIGHTS = "fused_weights"


@dataclass(frozen=True)
class Fused:
    """A weight that is its parts' concatenation along `dim`: (the part's name, its size along
    `dim`), in order. A layout that repacks the weight (int4 codes into CUDA's tiles of 8 rows)
    keeps each part's share of the dim."""

    dim: int
    parts: tuple[tuple[str, int], ...]

    def split_sizes(self, length: int) -> list[int]:
        """The parts' sizes along a stored dim of `length`; ValueError where they do not fill
        it (a record that does not describe the weight)."""
        sizes = [size for _, size in self.parts]
        total = sum(sizes)
        if (
            length <= 0
            or min(sizes, default=0) <= 0
            or any(length * size % total for size in sizes)
        ):
            raise ValueError(f"parts of sizes {sizes} do not fill {length}")
        return [length * size // total for size in sizes]


def to_json(fused: Mapping[str, Fused]) -> str:
    return json.dumps({name: {"dim": f.dim, "parts": f.parts} for name, f in fused.items()})


def from_json(text: str) -> dict[str, Fused]:
    """The record `to_json` wrote; ValueError where the text is not one."""
    try:
        return {
            str(name): Fused(int(f["dim"]), tuple((str(n), int(s)) for n, s in f["parts"]))
            for name, f in json.loads(text).items()
        }
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{FUSED_WEIGHTS} is not a record of fused weights ({error})") from error
