"""Live shapes and the order validation runs them in: one loaded instance from the largest down
to the smallest and back up, so state kept from a larger shape cannot hide a bug at a smaller
one, then a newly loaded instance at the smallest, which catches what only a first execution
at a small shape gets wrong. And the step MLflow files each shape's metrics under."""

from __future__ import annotations

from collections.abc import Sequence

# One live shape: a size for every dynamic dim, by name.
LiveShape = dict[str, int]
# Which loaded instance runs an execution: the same one that runs every shape, or a new one
# loaded for it.
SAME_INSTANCE, NEW_INSTANCE = "same instance", "new instance"


def run_order(shapes: Sequence[LiveShape]) -> list[LiveShape]:
    """From the largest down to the smallest, then back up, so one instance shrinks and grows."""
    descending = list(reversed(shapes))
    return descending + descending[-2::-1]


def executions(shapes: Sequence[LiveShape]) -> list[tuple[LiveShape, str]]:
    """Every execution of the plan, in order, with the instance that runs it; `shapes` smallest
    first."""
    return [(shape, SAME_INSTANCE) for shape in run_order(shapes)] + [(shapes[0], NEW_INSTANCE)]


def label(shape: LiveShape) -> str:
    return ",".join(f"{name}={size}" for name, size in shape.items())


def steps(shapes: Sequence[LiveShape]) -> list[int]:
    """MLflow's step of each shape, unique within the plan. With one dynamic dim, its live size,
    so the UI plots error against size; with several, no one size tells shapes apart (batch=8
    with seq=1 or seq=64), so the shape's position in the plan, which `label` names."""
    if all(len(shape) == 1 for shape in shapes):
        return [next(iter(shape.values())) for shape in shapes]
    return list(range(len(shapes)))
