"""The partition report's figures, table and strict verdict, and the policy's verdict per node."""

from __future__ import annotations

import pytest
import torch

from exporter.artifact.partition import (
    CPU,
    DELEGATED,
    NAMED,
    UNSUPPORTED,
    NodePlacement,
    PartitionSummary,
)
from exporter.backends.common.policy import Policy, op_name
from exporter.backends.common.strict import enforce
from exporter.config import FallbackConfig, FallbackPolicy
from exporter.errors import LoweringFailed

UNBACKED = "XNNPACK takes no tensor whose size is data-dependent (unbacked)"
REFUSED = "invalid dtype"

SUMMARY = PartitionSummary(
    nodes=(
        NodePlacement("view_1", "aten.view_copy.default", CPU, UNSUPPORTED, UNBACKED),
        NodePlacement("view_2", "aten.view_copy.default", CPU, UNSUPPORTED, REFUSED),
        NodePlacement("view_3", "aten.view_copy.default", CPU, UNSUPPORTED, REFUSED),
        NodePlacement("linear", "aten.linear.default", "XnnpackBackend", DELEGATED),
    ),
    delegates=1,
)


def test_figures_count_compute_nodes_inside_and_outside_the_delegates() -> None:
    assert (SUMMARY.delegated_nodes, SUMMARY.fallback_op_count) == (1, 3)
    assert SUMMARY.delegated_fraction == 0.25
    assert SUMMARY.ops_outside() == {"aten.view_copy.default": 3}
    assert PartitionSummary.from_json(SUMMARY.to_json()) == SUMMARY


def test_the_table_has_one_row_per_place_reason_and_op_and_lists_each_detail() -> None:
    rows = [line.split() for line in SUMMARY.table().splitlines()]
    assert rows[1] == ["cpu", "unsupported", "by", "the", "backend", "aten.view_copy.default", "3"]
    assert rows[2] == ["XnnpackBackend", "delegated", "aten.linear.default", "1"]
    text = SUMMARY.table()
    assert f"  {UNBACKED}: aten.view_copy.default" in text
    assert f"  {REFUSED}: aten.view_copy.default" in text


def test_strict_lists_each_op_left_outside_with_its_reason() -> None:
    enforce(SUMMARY, FallbackConfig(policy=FallbackPolicy.auto), "XNNPACK")
    with pytest.raises(LoweringFailed) as failure:
        enforce(SUMMARY, FallbackConfig(policy=FallbackPolicy.strict), "XNNPACK")
    message = str(failure.value)
    assert "3 compute nodes would run outside the XNNPACK delegate" in message
    assert f"aten.view_copy.default x2: {REFUSED}" in message
    assert f"aten.view_copy.default x1: {UNBACKED}" in message


def test_a_named_op_covers_the_ops_export_decomposes_it_into() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    traced = torch.export.export(module, (torch.randn(4, 8),))
    fallback = FallbackConfig(
        policy=FallbackPolicy.auto, ops=["aten.linear.default", "aten.nonzero.default"]
    )
    policy = Policy(fallback, traced)
    assert policy.unmatched_ops() == {"aten.nonzero.default"}
    decomposed = traced.run_decompositions().graph.nodes
    reasons = {op_name(n): policy.reason(n) for n in decomposed if n.op == "call_function"}
    assert reasons["aten.addmm.default"] == (NAMED, "fallback.ops has aten.linear.default")
    assert reasons["aten.relu.default"] is None
