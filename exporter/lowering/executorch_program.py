"""Lowering to an ExecuTorch program under a partitioner (XNNPACK's or WebGPU's): the exported
program -> edge dialect -> partitioned into delegates -> a .pte, and the partition report of
where every compute node ended up and why."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.lowered_backend_module import LoweredBackendModule

from exporter.export import Exported
from exporter.files import atomic_path
from exporter.lowering.artifact import Artifact, Output
from exporter.lowering.partition import CPU, DELEGATED, NodePlacement, PartitionSummary
from exporter.lowering.policy import Policy, op_name

log = logging.getLogger(__name__)


def lowered_to_pte(
    exported: Exported,
    partitioner: Any,
    why_on_cpu: Callable[[torch.fx.Node], tuple[str, str]],
    target: Output,
    out_dir: Path,
) -> Artifact:
    """Lowers with `partitioner` (its `listening()` context open) and writes the .pte; the
    partition report places every node, with `why_on_cpu` for the nodes left out."""
    with partitioner.listening():
        edge = to_edge_transform_and_lower(exported.program, partitioner=[partitioner])
    partition = summarize(edge.exported_program().graph_module, why_on_cpu)
    log.info("[lower] %s", partition.describe())
    program = edge.to_executorch()
    path = out_dir / target.file
    with atomic_path(path) as temporary, temporary.open("wb") as file:
        program.write_to_file(file)
    return Artifact.at(path, target, partition)


def announced_policy(partitioner: str, fallback: Any, exported: Exported) -> Policy:
    """The policy of an ExecuTorch lowering, logged, with a warning for ops it names in vain."""
    log.info(
        "[lower] ExecuTorch: %s partitioner (fallback=%s, ops=%s, min_block_size=%d)",
        partitioner,
        fallback.policy.value,
        fallback.ops,
        fallback.min_block_size,
    )
    # From the program as export traced it, before lowering decomposes its ops.
    policy = Policy(fallback, exported.program)
    if policy.unmatched_ops():
        log.warning(
            "[lower] fallback.ops names %s, which no op of this program is",
            ", ".join(sorted(policy.unmatched_ops())),
        )
    return policy


def summarize(
    graph_module: torch.fx.GraphModule, why_on_cpu: Callable[[torch.fx.Node], tuple[str, str]]
) -> PartitionSummary:
    """Places every compute node, inside a delegate (by backend id) or on the CPU, with why:
    `why_on_cpu` gives the (reason, detail) of a node the partitioner left out."""
    nodes: list[NodePlacement] = []
    delegates = 0
    for node in graph_module.graph.nodes:
        lowered = getattr(graph_module, node.target) if node.op == "get_attr" else None
        if isinstance(lowered, LoweredBackendModule):
            delegates += 1
            nodes.extend(
                NodePlacement(inner.name, op_name(inner), lowered.backend_id, DELEGATED)
                for inner in lowered.original_module.graph.nodes
                if is_compute(inner)
            )
        elif is_compute(node):
            reason, detail = why_on_cpu(node)
            nodes.append(NodePlacement(node.name, op_name(node), CPU, reason, detail))
    return PartitionSummary(nodes=tuple(nodes), delegates=delegates)


def is_compute(node: torch.fx.Node) -> bool:
    """An operator call that produces tensors; getitem, delegate calls and size math are not."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, Sequence) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)
