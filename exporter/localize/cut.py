"""An exported program cut after some of its nodes: those nodes' values become its only outputs,
everything they do not need is dropped (weights included), and every user input stays, so the
program runs on the job's inputs and lowers like the whole one."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils import _pytree as pytree

# Inputs a cut program keeps only where its nodes read them.
_CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def tensor_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    """The program's operator calls that make one tensor, in topological order: the nodes a cut
    can end at and a divergence can be found in (a multi-output op's tensors are its getitems)."""
    return [
        node
        for node in program.graph.nodes
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
    ]


def cut(program: ExportedProgram, names: Sequence[str]) -> ExportedProgram:
    """The program computing only the nodes `names`, returned in that order."""
    graph_module = copy.deepcopy(program.graph_module)
    graph = graph_module.graph
    nodes = {node.name: node for node in graph.nodes}
    outputs = [nodes[name] for name in names]
    graph.output_node().args = (tuple(outputs),)
    graph.eliminate_dead_code(is_impure_node=_is_kept)
    unused = {
        node.name
        for node in graph.nodes
        if node.op == "placeholder" and not node.users and _is_constant(program, node.name)
    }
    for node in list(graph.nodes):
        if node.name in unused:
            graph.erase_node(node)
    graph_module.recompile()

    input_specs = [
        spec
        for spec in program.graph_signature.input_specs
        if getattr(spec.arg, "name", None) not in unused
    ]
    kept = {spec.target for spec in input_specs if spec.kind in _CONSTANT_KINDS}
    signature = ExportGraphSignature(
        input_specs=input_specs,
        output_specs=[
            OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=node.name), None)
            for node in outputs
        ],
    )
    module_call_graph = copy.deepcopy(program.module_call_graph)
    root = module_call_graph[0].signature
    if root is not None:
        # The program returns a tuple of the cut's values, whatever the model returned.
        root.out_spec = pytree.tree_flatten(tuple(outputs))[1]
    return ExportedProgram(
        root=graph_module,
        graph=graph,
        graph_signature=signature,
        state_dict={k: v for k, v in program.state_dict.items() if k in kept},
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=module_call_graph,
        example_inputs=program.example_inputs,
        constants={k: v for k, v in program.constants.items() if k in kept},
        verifiers=program.verifiers,
    )


def _is_kept(node: torch.fx.Node) -> bool:
    """Whether a node the cut's outputs do not need stays: the checks of sizes do. A tensor op
    torch counts as impure because it could draw random numbers (scaled_dot_product_attention,
    for its dropout) and the check of a tensor's dtype that a `.to()` leaves do not: each would
    keep what it reads and everything above it (a cut after the 11th of the default Llama's 179
    nodes kept 171)."""
    if node.op != "call_function":
        return node.is_impure()
    if node.target is torch.ops.aten._assert_tensor_metadata.default:
        return False
    return node.is_impure() and not isinstance(node.meta.get("val"), torch.Tensor)


def _is_constant(program: ExportedProgram, placeholder: str) -> bool:
    return any(
        spec.kind in _CONSTANT_KINDS and getattr(spec.arg, "name", None) == placeholder
        for spec in program.graph_signature.input_specs
    )
