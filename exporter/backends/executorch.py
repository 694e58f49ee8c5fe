"""ExecuTorch with the XNNPACK delegate: exported program -> edge dialect -> partitioned -> .pte.

The fallback policy maps onto XNNPACK's partitioner: nodes the policy keeps off the backend
never pass its per-op constraint checks, and partitions with fewer compute nodes than
`fallback.min_block_size` are not delegated. What XNNPACK refuses, and its own reason, is read
from the partitioner's "why no partition" debug log while it runs.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name
from executorch.exir.backend.utils import WhyNoPartition
from executorch.exir.lowered_backend_module import LoweredBackendModule
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols
from torch.fx.passes.infra.partitioner import Partition

from exporter.backends.artifact import Artifact, Output
from exporter.backends.debug_log import captured
from exporter.backends.partition import (
    CPU,
    DELEGATED,
    UNSUPPORTED,
    NodePlacement,
    PartitionSummary,
    Policy,
    op_name,
)
from exporter.config import BackendConfig, Device, FallbackConfig
from exporter.errors import ConfigError
from exporter.export import Exported
from exporter.files import atomic_path

log = logging.getLogger(__name__)

DELEGATE = "XNNPACK"
_XNNPACK_LOGGER = "executorch.backends.xnnpack"


def check(backend: BackendConfig, fallback: FallbackConfig) -> None:
    # ExecuTorch itself is one of the project's dependencies; XNNPACK is its CPU delegate.
    if backend.device is not Device.cpu:
        raise ConfigError(
            f"backend=executorch runs XNNPACK on the CPU, not on backend.device="
            f"{backend.device.value}; allowed: backend.device=cpu."
        )


def output(backend: BackendConfig) -> Output:
    return Output(file="model.pte", format="pte", device=Device.cpu)


def toolchain(backend: BackendConfig) -> dict[str, str]:
    return {"executorch": importlib.metadata.version("executorch")}


class PolicyPartitioner(XnnpackPartitioner):
    """XNNPACK's partitioner under a fallback policy; remembers what it left out and why."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        # Node name -> size of the block it was in, for blocks under min_block_size.
        self.small_blocks: dict[str, int] = {}
        # Node name -> XNNPACK's reason for refusing it.
        self.refusals: dict[str, str] = {}
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
        # XNNPACK keeps ops it takes whole (linear) from decomposing, but only a delegate can
        # run them so; a block dropped for its size must fall back to portable kernels, so
        # with min_block_size > 1 everything decomposes first.
        if self.policy.fallback.min_block_size > 1:
            return [], None
        return super().ops_to_not_decompose(ep)

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


def lower(
    exported: Exported, backend: BackendConfig, fallback: FallbackConfig, out_dir: Path
) -> Artifact:
    partitioner = PolicyPartitioner(announced_policy("XNNPACK", fallback, exported))
    return lowered_to_pte(
        exported,
        partitioner,
        lambda node: _why_on_cpu(node, partitioner),
        output(backend),
        out_dir,
    )


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


def announced_policy(partitioner: str, fallback: FallbackConfig, exported: Exported) -> Policy:
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


def _why_on_cpu(node: torch.fx.Node, partitioner: PolicyPartitioner) -> tuple[str, str]:
    kept_off = partitioner.policy.reason(node)
    if kept_off:
        return kept_off
    if node.name in partitioner.small_blocks:
        size = partitioner.small_blocks[node.name]
        return partitioner.policy.small_block(size)
    if not partitioner.supports(node):
        return UNSUPPORTED, "XNNPACK has no kernel for this op"
    if _touches_unbacked_size(node):
        return UNSUPPORTED, "XNNPACK takes no tensor whose size is data-dependent (unbacked)"
    return UNSUPPORTED, partitioner.refusals.get(node.name, "XNNPACK's constraints refused it")


def _touches_unbacked_size(node: torch.fx.Node) -> bool:
    values = [node.meta.get("val")] + [
        arg.meta.get("val") for arg in node.all_input_nodes if arg.op != "get_attr"
    ]
    return any(
        isinstance(value, torch.Tensor) and has_free_unbacked_symbols(value) for value in values
    )


def is_compute(node: torch.fx.Node) -> bool:
    """An operator call that produces tensors; getitem, delegate calls and size math are not."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return False
    value = node.meta.get("val")
    values = value if isinstance(value, Sequence) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) for v in values)
