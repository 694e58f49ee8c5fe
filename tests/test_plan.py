"""The live-shape plan and the order one loaded instance runs it in."""

from __future__ import annotations

from exporter.models import DynamicDim
from exporter.validate.plan import plan, run_order

SEQ = DynamicDim("seq", (("input_ids", 1),), 1, 128)


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
