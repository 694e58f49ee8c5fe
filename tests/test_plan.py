"""The live-shape plan and the order one loaded instance runs it in."""

from __future__ import annotations

from exporter.models import DynamicDim
from exporter.validate.plan import plan
from runtimes.verdict.shapes import label, run_order, steps

SEQ = DynamicDim("seq", (("input_ids", 1),), 1, 128)
BATCH = DynamicDim("batch", (("x", 0),), 1, 8)


def sizes(shapes: list[dict[str, int]]) -> list[int]:
    return [shape["seq"] for shape in shapes]


def test_plan_covers_min_min_plus_one_odd_middle_max_minus_one_and_max() -> None:
    assert sizes(plan([SEQ], [], 0, seed=0)) == [1, 2, 65, 127, 128]


def test_extra_and_random_sizes_are_in_bounds_deduplicated_and_seeded() -> None:
    shapes = sizes(plan([SEQ], [17, 2], 5, seed=3))
    assert shapes == sorted(set(shapes))
    assert {1, 2, 17, 65, 127, 128} <= set(shapes)
    assert all(1 <= size <= 128 for size in shapes)
    assert shapes == sizes(plan([SEQ], [17, 2], 5, seed=3))


def test_a_narrow_range_plans_each_size_once() -> None:
    assert sizes(plan([DynamicDim("seq", (), 3, 4)], [], 0, seed=0)) == [3, 4]
    assert sizes(plan([DynamicDim("seq", (), 5, 5)], [], 0, seed=0)) == [5]


def test_one_instance_runs_max_down_to_min_and_back_up() -> None:
    order = sizes(run_order(plan([SEQ], [], 0, seed=0)))
    assert order == [128, 127, 65, 2, 1, 2, 65, 127, 128]


def test_several_dims_take_their_own_bounds_rank_by_rank() -> None:
    batch = DynamicDim("batch", (("x", 0),), 2, 8)
    shapes = plan([batch, SEQ], [], 0, seed=0)
    assert shapes[0] == {"batch": 2, "seq": 1}
    assert shapes[-1] == {"batch": 8, "seq": 128}


def test_two_dims_run_the_diagonal_and_every_corner_fewest_elements_first() -> None:
    seq = DynamicDim("seq", (("x", 1),), 1, 64)
    shapes = [(s["batch"], s["seq"]) for s in plan([BATCH, seq], [], 0, seed=0)]
    # The diagonal (min, min+1, odd middle, max-1, max of each) and the mixed corners.
    assert shapes == [(1, 1), (2, 2), (8, 1), (1, 64), (5, 33), (7, 63), (8, 64)]


def test_three_dims_get_all_eight_corners_once() -> None:
    heads = DynamicDim("heads", (("x", 2),), 1, 4)
    shapes = plan([BATCH, SEQ, heads], [3], 2, seed=1)
    triples = [(s["batch"], s["seq"], s["heads"]) for s in shapes]
    corners = {(b, s, h) for b in (1, 8) for s in (1, 128) for h in (1, 4)}
    assert corners <= set(triples)
    assert len(triples) == len(set(triples))
    elements = [b * s * h for b, s, h in triples]
    assert elements == sorted(elements)


def test_the_step_of_one_dim_is_its_size() -> None:
    assert steps(plan([SEQ], [], 0, seed=0)) == [1, 2, 65, 127, 128]


def test_the_steps_of_several_dims_are_positions_and_labels_name_the_shapes() -> None:
    shapes = plan([BATCH, SEQ], [5], 2, seed=0)
    assert steps(shapes) == list(range(len(shapes)))
    assert len({label(shape) for shape in shapes}) == len(shapes)
    assert label(shapes[2]) == "batch=8,seq=1"
