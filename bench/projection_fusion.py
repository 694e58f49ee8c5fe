"""Projections that read the same input as one matmul, for bench/aoti_options.py to measure: in
an exported program, the linear layers without bias (bfloat16's q/k/v, gate/up) or the int4
kernel's calls of one group (exporter/quantize/packed.py) that take the same input node, their
weights concatenated along the output rows into one new buffer, the product split back. A decode
step launches one GEMV where it launched two or three: on an H200, a 2048-wide q/k/v in bfloat16
takes 8.0 us fused against 3 x 5.0.

The int4 kernel's packing keeps rows in blocks of 64 and its scales and zeros per output row, so
layers whose rows are whole blocks concatenate as they are. Weights no call reads any more leave
the program.
"""

from __future__ import annotations

import copy
import operator
from collections import defaultdict

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec

from runtimes.int4_kernels import buffer_before

_LINEAR = torch.ops.aten.linear.default
_INT4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_SPLIT = torch.ops.aten.split_with_sizes.default
_SAME_VALUES = (
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
)


def fused_projections(program: ExportedProgram) -> ExportedProgram:
    """`program` with each set of projections of one input fused (the module docstring)."""
    graph_module = copy.deepcopy(program.graph_module)
    graph = graph_module.graph
    signature = program.graph_signature
    buffer_of = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    state = dict(program.state_dict)
    specs = list(signature.input_specs)
    sets: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.target is _LINEAR and len(node.args) == 2 and node.args[1].name in buffer_of:
            sets[(_LINEAR, *_source(node.args[0]))].append(node)
        elif node.target is _INT4 and node.args[1].name in buffer_of:
            sets[(_INT4, *_source(node.args[0]), node.args[2])].append(node)
    first_user_input = next(n for n in graph.nodes if n.name in signature.user_inputs)
    for key, calls in sets.items():
        if len(calls) < 2:
            continue
        weights = [buffer_of[call.args[1].name] for call in calls]
        name = weights[0] + "_fused"
        values = [state[weight] for weight in weights]
        sizes = [value.shape[0] for value in values]
        fused = buffer_before(first_user_input, specs, state, name, torch.cat(values), calls[0])
        args = [calls[0].args[0], fused]
        if key[0] is _INT4:
            table = torch.cat([state[buffer_of[call.args[3].name]] for call in calls], dim=1)
            scales = buffer_before(
                first_user_input, specs, state, name + "_scales", table, calls[0]
            )
            args += [calls[0].args[2], scales]
        # Before the first of the calls: it reads only their input and buffers, and each call's
        # users come after that call.
        with graph.inserting_before(calls[0]):
            product = _call(graph, key[0], tuple(args))
            parts = _call(graph, _SPLIT, (product, sizes, -1))
            split = [_call(graph, operator.getitem, (parts, i)) for i in range(len(calls))]
        for call, part in zip(calls, split, strict=True):
            call.replace_all_uses_with(part)
            graph.erase_node(call)
    _drop_unread(graph, specs, state)
    graph.lint()
    graph_module.recompile()
    new_signature = type(signature)(input_specs=specs, output_specs=signature.output_specs)
    return program._update(graph_module, new_signature, state_dict=state)


def _source(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple]:
    """The node an input comes from through ops that change no value (a packed layer rounds its
    own copy of its input to bfloat16 and flattens it), and those ops: two layers whose inputs
    come from one node by the same ops read the same input."""
    steps = []
    while node.op == "call_function" and node.target in _SAME_VALUES:
        steps.append((node.target, tuple(node.args[1:]), tuple(sorted(node.kwargs.items()))))
        node = node.args[0]
    return node, tuple(steps)


def _call(graph: torch.fx.Graph, target: object, args: tuple) -> torch.fx.Node:
    """A new call of `target` with its fake value, as export gives every node one."""
    node = graph.call_function(target, args)
    fake = [a.meta["val"] for a in args if isinstance(a, torch.fx.Node)]
    values = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args)
    with _fake_mode(fake):
        node.meta["val"] = target(*values)
    return node


def _fake_mode(values: list) -> object:
    first = values[0][0] if isinstance(values[0], list | tuple) else values[0]
    return first.fake_mode


def _drop_unread(
    graph: torch.fx.Graph, specs: list[InputSpec], state: dict[str, torch.Tensor]
) -> None:
    """Parameters and buffers that no node reads, out of the graph, the specs and the state."""
    for node in list(graph.find_nodes(op="placeholder")):
        spec = next(s for s in specs if s.arg.name == node.name)
        if node.users or spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        graph.erase_node(node)
        specs.remove(spec)
        if spec.target not in {s.target for s in specs}:
            state.pop(spec.target, None)
