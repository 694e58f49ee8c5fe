"""Lowering to an ExecuTorch program under a partitioner (XNNPACK's or WebGPU's): the exported
program -> edge dialect -> partitioned into delegates -> a .pte, and the partition report of
where every compute node ended up and why.

With external weights the program's constants go to a data file beside the .pte (ExecuTorch's
.ptd, a FlatTensor), those a delegate serializes as well as those left to the program's own
kernels: the .pte keeps the program only."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.backend.backend_details import BackendDetails
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.backend.utils import WhyNoPartition, is_same_node
from executorch.exir.lowered_backend_module import LoweredBackendModule
from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.external_constants_pass import is_param_node
from torch.export import ExportedProgram

from exporter.artifact import Artifact, Output
from exporter.artifact.partition import (
    CPU,
    DELEGATED,
    NodePlacement,
    PartitionSummary,
    WrongKernelAvoided,
)
from exporter.backends.common.policy import Policy, is_compute, op_name
from exporter.export import ENCODE, Exported
from exporter.files import atomic_path
from exporter.process import progress

log = logging.getLogger(__name__)

# The .pte's method that runs the model (ExecuTorch's default); a decoder's encode method is
# named as the exported program names it (exporter.export.ENCODE), as the target loads it.
FORWARD = "forward"


def lowered_to_pte(
    exported: Exported,
    partitioner: Any,
    why_on_cpu: Callable[[torch.fx.Node], tuple[str, str]],
    target: Output,
    out_dir: Path,
    edge_passes: Sequence[Callable[[Any], Any]] = (),
    wrong_kernels_avoided: Sequence[WrongKernelAvoided] = (),
) -> Artifact:
    """Lowers with `partitioner` (its `listening()` context open) and writes the .pte, and with
    `target.data_file` the weights into that file beside it; the partition report places every
    node, with `why_on_cpu` for the nodes left out, and lists `wrong_kernels_avoided`, the
    nodes the program was rewritten at before. `edge_passes` rewrite the edge program before it
    is partitioned."""
    # Without autograd: a program loaded from program.pt2 whose buffers it writes in place (a
    # KV cache) fails ExecuTorch's passes, which run the graph, as "a leaf Variable that
    # requires grad is being used in an in-place operation".
    with torch.no_grad(), _weights_shared_with_preprocess():
        return _lowered_to_pte(
            exported, partitioner, why_on_cpu, target, out_dir, edge_passes, wrong_kernels_avoided
        )


def _lowered_to_pte(
    exported: Exported,
    partitioner: Any,
    why_on_cpu: Callable[[torch.fx.Node], tuple[str, str]],
    target: Output,
    out_dir: Path,
    edge_passes: Sequence[Callable[[Any], Any]],
    wrong_kernels_avoided: Sequence[WrongKernelAvoided],
) -> Artifact:
    try:
        data_file = target.data_file
        # ExecuTorch names a data file after the tag its constants carry: "model" -> model.ptd.
        tag = Path(data_file).stem if data_file else None
        # The partitioner says when it partitions and what it then delegates (`delegating`).
        progress.doing("converting to ExecuTorch's edge dialect")
        # A decoder's encode method is a method of the .pte beside `forward`, whose mutable
        # buffers (the cross-attention cache it writes) the memory plan shares by name.
        programs = (
            exported.program
            if exported.encode is None
            else {FORWARD: exported.program, ENCODE: exported.encode}
        )
        with partitioner.listening():
            edge = to_edge_transform_and_lower(
                programs,
                transform_passes=[*edge_passes, *([TagDelegateConstants(tag)] if tag else [])],
                partitioner=[partitioner],
                # Methods of the .pte that return the constants an LLM runner reads.
                constant_methods=exported.runner_metadata or None,
            )
        # Before emitting, which makes the program's bytes: what ExecuTorch kept of the lowering
        # holds a copy of the delegated weights (a 2-layer llama_1b's emitting peaked 1 GB lower).
        forget_lowered_graphs()
        gc.collect()
        partition = dataclasses.replace(
            summarize(edge.exported_program(FORWARD).graph_module, why_on_cpu),
            wrong_kernels_avoided=tuple(wrong_kernels_avoided),
        )
        log.info("[lower] %s", partition.describe())
        progress.doing("emitting the ExecuTorch program")
        # The constants no delegate took are tagged here, as they are emitted.
        program = edge.to_executorch(
            ExecutorchBackendConfig(
                external_constants=(lambda _node: tag) if tag else False,
                memory_planning_pass=MemoryPlanningPass(
                    share_mutable_buffers=exported.encode is not None
                ),
            )
        )
        path = out_dir / target.file
        progress.doing(f"writing {target.file}")
        with atomic_path(path) as temporary, temporary.open("wb") as file:
            program.write_to_file(file)
        if data_file:
            # Written straight into `out_dir`, a folder of this job's own (the cache's staging
            # folder or the run dir's partial one) that a failed job never publishes.
            program.write_tensor_data_to_file(str(out_dir))
            _log_sizes(path, out_dir / data_file)
        return Artifact.at(path, target, partition)
    finally:
        forget_lowered_graphs()


def delegating(result: PartitionResult, delegate: str) -> str:
    """What lowering does once the partitioner has tagged `result`, in a progress line's words."""
    tags = set(result.partition_tags)
    nodes = sum(
        node.meta.get("delegation_tag") in tags
        for node in result.tagged_exported_program.graph.nodes
    )
    partitions = f"{len(tags)} partition{'' if len(tags) == 1 else 's'}"
    return f"lowering {partitions} ({nodes} nodes) to {delegate}"


def forget_lowered_graphs() -> None:
    """Drops what ExecuTorch keeps of a lowering in its module-level state, which would hold the
    lowered graphs, and through their nodes' TensorSpecs a copy of every weight, for the rest of
    the process: `is_same_node`'s unbounded lru_cache (whose keys are the graphs' nodes) and the
    XNNPACK partitioner configs' module-level WhyNoPartition objects (each keeps the last node it
    refused)."""
    is_same_node.cache_clear()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("executorch."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, WhyNoPartition):
                value.node = None


@contextlib.contextmanager
def _weights_shared_with_preprocess() -> Iterator[None]:
    """While open, the copy of each partition that ExecuTorch hands a delegate's `preprocess`
    shares the program's weight tensors instead of copying them.

    ExecuTorch copies every partition's program before any delegate serializes it (so that a
    backend may change its graph), weights included: with XNNPACK, all delegated weights held
    twice at once, on top of the bytes preprocess makes of them (a 1B Llama in float32: its
    4.95 GB). `copy_exported_program_for_preprocess` is the classmethod a
    backend overrides to copy less; ExecuTorch's own CUDA backend shares the tensors the same
    way in its low-memory mode. XNNPACK's and Vulkan's preprocess replace weights in the
    copy's state dict and never write into a tensor, so the graphs and the dicts stay the
    copy's own and the tensors can be shared."""
    original = BackendDetails.__dict__["copy_exported_program_for_preprocess"]
    BackendDetails.copy_exported_program_for_preprocess = classmethod(_copy_sharing_weights)
    try:
        yield
    finally:
        BackendDetails.copy_exported_program_for_preprocess = original


def _copy_sharing_weights(
    _backend: type[BackendDetails], program: ExportedProgram, _specs: list[CompileSpec]
) -> ExportedProgram:
    shared = {
        id(tensor): tensor
        for tensors in (program.state_dict, program.constants)
        for tensor in tensors.values()
        if isinstance(tensor, torch.Tensor)
    }
    return copy.deepcopy(program, shared)


class TagDelegateConstants(ExportedProgramPassBase):
    """Tags the edge program's weights (parameters, buffers, lifted constants) for the data
    file `tag`: a delegate that serializes a tagged constant (XNNPACK does) puts it into the
    program's named data under that tag, which ExecuTorch writes to `<tag>.ptd`.

    ExecuTorch 1.5's documented route tags the unlifted module's get_attr nodes and exports
    again (`delegate_external_constants_pass_unlifted`); tagging the lifted program's
    placeholders after edge conversion sets the same `delegate_constant_tag` without a second
    export, which would need the model's inputs and dynamic shapes here."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult:
        tagged = False
        for node in exported_program.graph_module.graph.nodes:
            if node.op == "placeholder" and is_param_node(exported_program, node):
                node.meta.setdefault("custom", {})["delegate_constant_tag"] = self.tag
                tagged = True
        return ExportedProgramPassResult(exported_program, tagged)


def _log_sizes(program: Path, data: Path) -> None:
    if data.exists():
        log.info(
            "[lower] %s: %d bytes; weights in %s: %d bytes",
            program.name,
            program.stat().st_size,
            data.name,
            data.stat().st_size,
        )
    else:
        log.info("[lower] %s holds no weights to keep outside; no %s", program.name, data.name)


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
