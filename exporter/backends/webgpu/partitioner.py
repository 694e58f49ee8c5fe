"""ExecuTorch's WebGPU partitioner under a fallback policy.

The policy maps onto the partitioner's operator blocklist: every op a node of the program is
kept off by the policy is blocked. Partitions with fewer compute nodes than
`fallback.min_block_size` are untagged after partitioning, so they stay on the CPU whole. What
the partitioner refuses, and its reason, is read from the messages it logs while lowering runs.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from executorch.backends.webgpu.partitioner import WebGPUPartitioner
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from torch.export import ExportedProgram

from exporter.backends.common.executorch_program import delegating, is_compute
from exporter.backends.common.partition import UNSUPPORTED
from exporter.backends.common.policy import Policy, op_name
from exporter.backends.webgpu import pattern_graphs
from exporter.process import progress

# The partitioner logs each node it refuses to the root logger, at INFO.
_REFUSAL = re.compile(
    r"\[Vulkan Partitioner\] Due to \[(?P<reason>.*?)\], skipping .*? = (?P<op>\S+?)\("
)


class PolicyPartitioner(Partitioner):
    """The WebGPU partitioner under a fallback policy; remembers what it left out and why."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        pattern_graphs.build_once()
        self.policy = policy
        # Node name -> size of the block it was in, for blocks under min_block_size.
        self.small_blocks: dict[str, int] = {}
        # Op name -> the partitioner's reasons for refusing nodes of it.
        self.refusals: dict[str, set[str]] = defaultdict(set)

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], object]:
        return WebGPUPartitioner().ops_to_not_decompose(ep)

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        progress.doing("partitioning for WebGPU")
        blocked = {
            node.target
            for node in exported_program.graph.nodes
            if node.op == "call_function" and self.policy.reason(node)
        }
        result = WebGPUPartitioner(operator_blocklist=list(blocked)).partition(exported_program)
        result = self._without_small_blocks(result)
        progress.doing(delegating(result, "WebGPU"))
        return result

    def _without_small_blocks(self, result: PartitionResult) -> PartitionResult:
        members: dict[str, list[torch.fx.Node]] = defaultdict(list)
        for node in result.tagged_exported_program.graph.nodes:
            if "delegation_tag" in node.meta:
                members[node.meta["delegation_tag"]].append(node)
        tags = dict(result.partition_tags)
        for tag, nodes in members.items():
            compute = [node for node in nodes if is_compute(node)]
            if len(compute) >= self.policy.fallback.min_block_size:
                continue
            self.small_blocks.update({node.name: len(compute) for node in compute})
            for node in nodes:
                del node.meta["delegation_tag"]
            tags.pop(tag, None)
        return PartitionResult(
            tagged_exported_program=result.tagged_exported_program, partition_tags=tags
        )

    @contextmanager
    def listening(self) -> Iterator[None]:
        """Collects the partitioner's refusals while lowering runs, and keeps its INFO chatter
        (it logs to the root logger) out of the job's log."""

        # A filter on the root logger sees only what is logged to it directly, as the Vulkan
        # backend does, not what other loggers propagate.
        def keep(record: logging.LogRecord) -> bool:
            match = _REFUSAL.match(str(record.msg))
            if match:
                self.refusals[match["op"]].add(match["reason"])
            return record.levelno >= logging.WARNING

        root = logging.getLogger()
        root.addFilter(keep)
        try:
            yield
        finally:
            root.removeFilter(keep)

    def why_on_cpu(self, node: torch.fx.Node) -> tuple[str, str]:
        kept_off = self.policy.kept_off(node, self.small_blocks)
        if kept_off:
            return kept_off
        name = op_name(node)
        reasons = self.refusals.get(name, set()) | self.refusals.get(
            name.removeprefix("aten."), set()
        )
        if not reasons:
            return UNSUPPORTED, "the WebGPU partitioner took no node of it"
        return UNSUPPORTED, f"WebGPU partitioner: {'; '.join(sorted(reasons))}"
