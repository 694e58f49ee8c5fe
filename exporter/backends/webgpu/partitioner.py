"""ExecuTorch's WebGPU partitioner under a fallback policy, for this project's WebGPU runtime.

The policy maps onto the partitioner's operator blocklist: every op a node of the program is
kept off by the policy is blocked, and so is every op that runtimes/loaders/webgpu has no kernel
for (the partitioner takes what ExecuTorch's native Vulkan runtime runs, which is more). Partitions
with fewer compute nodes than `fallback.min_block_size` are untagged after partitioning, so they
stay on the CPU whole. What the partitioner refuses, and its reason, is read from the messages it
logs while lowering runs.
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

from exporter.artifact.partition import UNSUPPORTED
from exporter.backends.common.executorch_program import delegating
from exporter.backends.common.policy import Policy, is_compute, op_name
from exporter.backends.webgpu import pattern_graphs
from exporter.process import progress
from runtimes.loaders import webgpu as webgpu_runtime

# The partitioner logs each node it refuses to the root logger, at INFO.
_REFUSAL = re.compile(
    r"\[Vulkan Partitioner\] Due to \[(?P<reason>.*?)\], skipping .*? = (?P<op>\S+?)\("
)
# Its reason for a node of a blocked op that it would otherwise take: the block's own reason
# says more.
_BLOCKED = "op is in blocklist"


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
        # The program's mutable buffers: placeholder name -> buffer name.
        self.mutable_buffers: dict[str, str] = {}
        # The ops of the nodes that read them, kept off every delegate.
        self.reader_ops: set[torch._ops.OpOverload] = set()
        # The program's ops that the runtime has no kernel for, kept off every delegate.
        self.without_kernel: set[torch._ops.OpOverload] = set()

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
        self.mutable_buffers = _mutable_buffers(exported_program)
        self.reader_ops = {
            reader.target
            for node in exported_program.graph.nodes
            if node.name in self.mutable_buffers
            for reader in node.users
            if reader.op == "call_function"
        }
        blocked |= self.reader_ops
        # By the op's name, which a delegated node keeps in the payload.
        self.without_kernel = {
            node.target
            for node in exported_program.graph.nodes
            if is_compute(node) and not webgpu_runtime.has_kernel(op_name(node))
        }
        blocked |= self.without_kernel
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
        read = [b for n in node.all_input_nodes if (b := self.mutable_buffers.get(n.name))]
        if read:
            return UNSUPPORTED, (
                f"it reads the mutable buffer {read[0]}, which a VulkanBackend payload would hold "
                "as a constant: mutable buffers and their readers stay in the program"
            )
        if node.target in self.reader_ops:
            return UNSUPPORTED, (
                "another node of its op reads a mutable buffer, and the partitioner keeps ops, "
                "not nodes, off the delegates"
            )
        name = op_name(node)
        reasons = self.refusals.get(name, set()) | self.refusals.get(
            name.removeprefix("aten."), set()
        )
        partitioner = f"WebGPU partitioner: {'; '.join(sorted(reasons - {_BLOCKED}))}"
        if node.target in self.without_kernel:
            runtime = "the WebGPU runtime has no kernel for it (runtimes/loaders/webgpu/kernels)"
            return UNSUPPORTED, runtime if reasons <= {_BLOCKED} else f"{runtime}; {partitioner}"
        if not reasons:
            return UNSUPPORTED, "the WebGPU partitioner took no node of it"
        return UNSUPPORTED, partitioner


def _mutable_buffers(program: ExportedProgram) -> dict[str, str]:
    """The buffers the program mutates (a KV cache's slots and fill count), by the name of
    their placeholders. The nodes that read them are kept off every delegate, by op (the
    partitioner blocks ops, not nodes). ExecuTorch 1.5's Vulkan serializer stores a buffer a
    delegate reads as a constant of the payload, its value at export, though the program passes
    the buffer's current value in: a delegate holding such a node would read a cache that never
    fills. Handing the buffer to the delegate instead (the partitioner's tag_mutated_buffer)
    fails to_backend ("Buffer output ... does not point to a buffer that exists"). Off the
    delegates, these nodes run on the CPU over the program's own buffers, which the program
    writes back after each call: the cache lives across the calls of one loaded program."""
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    return {
        name: buffer for name, buffer in signature.inputs_to_buffers.items() if buffer in mutated
    }
