"""ExecuTorch with the XNNPACK delegate: exported program -> edge dialect -> partitioned -> .pte."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.lowered_backend_module import LoweredBackendModule

from exporter.backends.artifact import Artifact
from exporter.backends.partition import CPU, NodePlacement, PartitionSummary
from exporter.config import BackendConfig
from exporter.export import Exported
from exporter.files import atomic_path

log = logging.getLogger(__name__)

FORMAT = "pte"
ARTIFACT_FILE = "model.pte"
DELEGATE = "XNNPACK"


def lower(exported: Exported, backend: BackendConfig, out_dir: Path) -> Artifact:
    log.info("[lower] ExecuTorch: XNNPACK partitioner")
    edge = to_edge_transform_and_lower(exported.program, partitioner=[XnnpackPartitioner()])
    partition = summarize(edge.exported_program().graph_module)
    log.info("[lower] %s", partition.describe())
    program = edge.to_executorch()
    path = out_dir / ARTIFACT_FILE
    with atomic_path(path) as temporary, temporary.open("wb") as file:
        program.write_to_file(file)
    return Artifact(path=path, format=FORMAT, partition=partition)


def summarize(graph_module: torch.fx.GraphModule) -> PartitionSummary:
    """Places every compute node: inside a delegate (by backend id) or on the CPU kernels."""
    nodes: list[NodePlacement] = []
    delegates = 0
    for node in graph_module.graph.nodes:
        lowered = getattr(graph_module, node.target) if node.op == "get_attr" else None
        if isinstance(lowered, LoweredBackendModule):
            delegates += 1
            nodes.extend(
                NodePlacement(inner.name, _op_name(inner), lowered.backend_id)
                for inner in lowered.original_module.graph.nodes
                if _is_compute(inner)
            )
        elif _is_compute(node):
            nodes.append(NodePlacement(node.name, _op_name(node), CPU))
    return PartitionSummary(nodes=tuple(nodes), delegates=delegates)


def _is_compute(node: torch.fx.Node) -> bool:
    """An operator call that produces tensors; getitem, delegate calls and size math are not."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, Sequence) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)


def _op_name(node: torch.fx.Node) -> str:
    # Edge ops wrap the ATen overload in `_op`; its str is "aten.view_copy.default".
    return str(getattr(node.target, "_op", node.target))
