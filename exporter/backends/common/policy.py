"""The fallback policy judged per node of a program being lowered: which nodes it keeps off the
backend, and why, in the partition report's words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.export import ExportedProgram

from exporter.artifact.partition import DATA_DEPENDENT, NAMED, SMALL_BLOCK
from exporter.config import FallbackConfig, FallbackPolicy


def op_name(node: torch.fx.Node) -> str:
    """ "aten.view_copy.default", for an ATen overload (str) and an edge op (__name__) alike;
    both have an `_op`, which is no name."""
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    return str(getattr(node.target, "__name__", node.target))


def is_compute(node: torch.fx.Node) -> bool:
    """An operator call that produces tensors: the nodes a partition report places. Getitem,
    delegate calls, size arithmetic on symbolic sizes and runtime asserts on it are not."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, Sequence) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


class Policy:
    """The fallback policy, judged per node of a program being lowered.

    A user naming an op means the op as export traced it: `aten.linear.default` keeps off the
    addmm that linear decomposes into. Nodes remember the torch call they came from
    (`torch_fn` metadata), so each call's traced ATen ops are collected before lowering."""

    def __init__(self, fallback: FallbackConfig, traced: ExportedProgram) -> None:
        self.fallback = fallback
        self.traced_ops: dict[str, set[str]] = {}
        for node in traced.graph.nodes:
            if node.op == "call_function":
                self.traced_ops.setdefault(_call_of(node), set()).add(op_name(node))

    def names_of(self, node: torch.fx.Node) -> set[str]:
        return {op_name(node)} | self.traced_ops.get(_call_of(node), set())

    def unmatched_ops(self) -> set[str]:
        """Names in fallback.ops that no traced op has."""
        return set(self.fallback.ops) - set().union(*self.traced_ops.values())

    def reason(self, node: torch.fx.Node) -> tuple[str, str] | None:
        """(reason, detail) where the policy keeps the node off the backend."""
        return policy_reason(self.names_of(node), makes_data_dependent_shape(node), self.fallback)

    def kept_off(
        self, node: torch.fx.Node, small_blocks: Mapping[str, int]
    ) -> tuple[str, str] | None:
        """(reason, detail) where the policy left the node outside every delegate: its own
        verdict, or the node was in a block too small (`small_blocks`: node name -> the size of
        its block); None where the backend left it out."""
        kept_off = self.reason(node)
        if kept_off:
            return kept_off
        if node.name in small_blocks:
            return SMALL_BLOCK, (
                f"its block had {small_blocks[node.name]} compute node(s), under "
                f"fallback.min_block_size={self.fallback.min_block_size}"
            )
        return None


def policy_reason(
    names: set[str], data_dependent: bool, fallback: FallbackConfig
) -> tuple[str, str] | None:
    """(reason, detail) where the policy keeps an op off the backend, for a backend that knows
    the op by `names` and whether its output size depends on tensor values."""
    named = sorted(names & set(fallback.ops))
    if named:
        return NAMED, f"fallback.ops has {named[0]}"
    if fallback.policy is FallbackPolicy.data_dependent and data_dependent:
        return DATA_DEPENDENT, "its output size depends on tensor values (fallback=data_dependent)"
    return None


def _call_of(node: torch.fx.Node) -> str:
    # ("linear_1", "builtin_function_or_method.linear"): the id of the torch call.
    torch_fn = node.meta.get("torch_fn")
    return str(torch_fn[0]) if torch_fn else f"node:{node.name}"


def makes_data_dependent_shape(node: torch.fx.Node) -> bool:
    """The node creates a size known only from tensor values (nonzero, x[mask], unique...)."""
    return node.op == "call_function" and bool(node.meta.get("unbacked_bindings"))
