"""XNNPACK's partitioner under a fallback policy.

Nodes the policy keeps off the backend never pass XNNPACK's per-op constraint checks, and
partitions with fewer compute nodes than `fallback.min_block_size` are not delegated. What
XNNPACK refuses, and its own reason, is read from the partitioner's "why no partition" debug
log while it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.backend.utils import WhyNoPartition
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols
from torch.fx.passes.infra.partitioner import Partition

from exporter.artifact.partition import UNSUPPORTED
from exporter.backends.common.debug_log import captured
from exporter.backends.common.executorch_program import delegating
from exporter.backends.common.policy import Policy
from exporter.process import progress

_XNNPACK_LOGGER = "executorch.backends.xnnpack"
_LINEAR = torch.ops.aten.linear.default


class PolicyPartitioner(XnnpackPartitioner):
    """XNNPACK's partitioner under a fallback policy; remembers what it left out and why."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        # Node name -> size of the block it was in, for blocks under min_block_size.
        self.small_blocks: dict[str, int] = {}
        # Node name -> XNNPACK's reason for refusing it.
        self.refusals: dict[str, str] = {}
        self.partitioned = False
        for config in self.target_partitioner_configs.values():
            config.check_constraints = self._under_policy(config.check_constraints)

    def _under_policy(
        self, check: Callable[[torch.fx.Node, ExportedProgram], bool]
    ) -> Callable[[torch.fx.Node, ExportedProgram], bool]:
        def check_under_policy(node: torch.fx.Node, program: ExportedProgram) -> bool:
            return self.policy.reason(node) is None and check(node, program)

        return check_under_policy

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        """XNNPACK's own (linear and the ops it takes whole), and every linear besides: one that
        XNNPACK refuses (a bfloat16 linear, or one the policy keeps off) then runs as
        ExecuTorch's linear kernel, ten times as fast as the matmul it would decompose to.

        ExecuTorch asks the returned check twice: while decomposing (keep this node?) and after
        partitioning (was a kept node left behind? an error if so). A linear left on the CPU is
        meant to be, so the check answers no once partitioning is over."""
        # XNNPACK's other ops are kept whole for its delegate only: with min_block_size > 1 a
        # block dropped for its size must fall back to portable kernels, so they decompose.
        ops, check = [], None
        if self.policy.fallback.min_block_size == 1:
            ops, check = super().ops_to_not_decompose(ep)

        def keep(node: torch.fx.Node) -> bool:
            if node.target == _LINEAR:
                return not self.partitioned
            return check(node) if check else node.target in ops

        return [*dict.fromkeys([*ops, _LINEAR])], keep

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        progress.doing("partitioning for XNNPACK")
        result = super().partition(exported_program)
        self.partitioned = True
        progress.doing(delegating(result, "XNNPACK"))
        return result

    def get_matched_nodes_from_configs(self, ep: ExportedProgram) -> list[list[torch.fx.Node]]:
        # A match also carries the nodes its anchor takes along (the relu fused into a linear);
        # those obey the policy too.
        matches = super().get_matched_nodes_from_configs(ep)
        kept = [[node for node in match if self.policy.reason(node) is None] for match in matches]
        return [match for match in kept if match]

    def generate_partitions(self, ep: ExportedProgram) -> list[Partition]:
        kept = []
        for partition in super().generate_partitions(ep):
            compute = [node for node in partition.nodes if node.op == "call_function"]
            if len(compute) >= self.policy.fallback.min_block_size:
                kept.append(partition)
            else:
                self.small_blocks.update({node.name: len(compute) for node in compute})
        return kept

    def supports(self, node: torch.fx.Node) -> bool:
        return format_target_name(node.target.__name__) in self.target_partitioner_configs

    @contextmanager
    def listening(self) -> Iterator[None]:
        """Collects XNNPACK's WhyNoPartition messages, logged at DEBUG, while partitioning."""
        with captured(_XNNPACK_LOGGER, self._note_refusal):
            yield

    def _note_refusal(self, record: logging.LogRecord) -> None:
        # WhyNoPartition is logged as the object itself and reused: read it now.
        why = record.msg
        if isinstance(why, WhyNoPartition) and why.node is not None:
            self.refusals.setdefault(why.node.name, why.reason)

    def why_on_cpu(self, node: torch.fx.Node) -> tuple[str, str]:
        """(reason, detail) of a node the lowering left outside every delegate."""
        kept_off = self.policy.kept_off(node, self.small_blocks)
        if kept_off:
            return kept_off
        if not self.supports(node):
            return UNSUPPORTED, "XNNPACK has no kernel for this op"
        if _touches_unbacked_size(node):
            return UNSUPPORTED, "XNNPACK takes no tensor whose size is data-dependent (unbacked)"
        return UNSUPPORTED, self.refusals.get(node.name, "XNNPACK's constraints refused it")


def _touches_unbacked_size(node: torch.fx.Node) -> bool:
    values = [node.meta.get("val")] + [
        arg.meta.get("val") for arg in node.all_input_nodes if arg.op != "get_attr"
    ]
    return any(
        isinstance(value, torch.Tensor) and has_free_unbacked_symbols(value) for value in values
    )
