"""The live-shape plan: which sizes of each dynamic dim validation runs (the order it runs them
in, and the step MLflow files each under, are runtimes/verdict/shapes.py's)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

from exporter.models import DynamicDim
from runtimes.verdict.shapes import LiveShape


def plan(
    dims: Sequence[DynamicDim], extra: Sequence[int], random_count: int, seed: int
) -> list[LiveShape]:
    """min, min+1, an odd size in the middle, max-1, max, the extra sizes and `random_count`
    seeded draws, deduplicated, smallest first (fewest elements, then by size dim by dim).

    With several dims, the k-th of those shapes takes each dim's k-th size (its own min with
    the others' mins, and so on), and every corner is added, each dim at its min or its max:
    the diagonal alone never runs batch=max with seq=min, where a kernel sized by one dim and
    indexed by the other goes wrong. One dim's corners are its min and max, already planned."""
    rng = random.Random(seed)
    per_dim = [_sizes(dim, extra, random_count, rng) for dim in dims]
    corners = itertools.product(*({dim.min, dim.max} for dim in dims))
    shapes = sorted({*zip(*per_dim, strict=True), *corners}, key=lambda s: (math.prod(s), s))
    return [dict(zip((dim.name for dim in dims), sizes, strict=True)) for sizes in shapes]


def _sizes(
    dim: DynamicDim, extra: Sequence[int], random_count: int, rng: random.Random
) -> list[int]:
    middle = (dim.min + dim.max) // 2
    middle += 1 - middle % 2
    planned = [dim.min, dim.min + 1, middle, dim.max - 1, dim.max, *extra]
    planned += [rng.randint(dim.min, dim.max) for _ in range(random_count)]
    return [min(max(size, dim.min), dim.max) for size in planned]
