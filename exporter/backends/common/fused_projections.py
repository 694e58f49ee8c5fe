"""int4 projections that read one input, computed by one call of PyTorch's int4 kernel: per
layer of a Llama, q, k and v become one call and gate and up another. Their codes are
concatenated along the output rows into one weight, their scales and zeros into one table, and
the product is split back into each projection's part.

At one row (a decode step), CUDA's int4 kernel takes about as long for a weight three times as
wide: on an H200, 7.44 us for q/k/v against 3 x 4.01, 14.16 for gate/up against 2 x 7.95
(bench/int4_packed.py). The whole Llama-3.2-1B-shaped int4 decode step went from 266 kernels to
218 and from 1.204 to 1.084 ms a token at fill 512 (docs/backends.md).

The packed layers (exporter/quantize/packed.py) hold whole blocks of rows (64: every CPU's block
divides it, runtimes/int4_kernels.py) and scales and zeros per output row, so their weights
concatenate as they are, in the CPU packing and in CUDA's tiles alike (a tile holds 8 rows).
The package records which weights each fused one holds (exporter/artifact/fused_weights.py), so
the weights audit compares each part with its own parameter.
"""

from __future__ import annotations

import copy
import operator
from collections import defaultdict
from collections.abc import Collection

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec

from exporter.artifact.fused_weights import Fused
from exporter.backends.common.graph_edits import Inserting
from runtimes.int4_kernels import buffer_before

_INT4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_SPLIT = torch.ops.aten.split_with_sizes.default
# Ops that change no value: a packed layer flattens its input and rounds its own copy of it to
# bfloat16, so two layers of one input read it through ops of their own.
_SAME_VALUES = (
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
)
# The packing [out, in // 2] and the table [in // group, out, 2] are concatenated along these.
_CODES_DIM, _TABLE_DIM = 0, 1


def fused_projections(
    program: ExportedProgram, keep: Collection[str] = ()
) -> tuple[ExportedProgram, dict[str, Fused]]:
    """`program` with the int4 kernel's calls of one input and one group made one call each
    (the module docstring), and what each fused weight holds, by its name; the program itself
    and no fused weights where no two calls share an input. A call whose weight or table another
    node reads too, or that is in `keep`, stays as it is: fusing it would store it twice."""
    signature = program.graph_signature
    buffer_of = signature.inputs_to_buffers
    sets: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in program.graph.nodes:
        if node.target is _INT4 and _alone(node, buffer_of, keep):
            sets[(*_source(node.args[0]), node.args[2])].append(node)
    if not any(len(calls) > 1 for calls in sets.values()):
        return program, {}
    graph_module = copy.deepcopy(program.graph_module)
    graph = graph_module.graph
    by_name = {node.name: node for node in graph.nodes}
    state = dict(program.state_dict)
    specs = list(signature.input_specs)
    first_user_input = next(n for n in graph.nodes if n.name in signature.user_inputs)
    fused: dict[str, Fused] = {}
    for calls in sets.values():
        if len(calls) < 2:
            continue
        calls = [by_name[call.name] for call in calls]
        buffers = []
        for position, dim in ((1, _CODES_DIM), (3, _TABLE_DIM)):
            names = [buffer_of[call.args[position].name] for call in calls]
            values = [state.pop(name) for name in names]
            name = names[0] + "_fused"
            sizes = tuple(value.shape[dim] for value in values)
            fused[name] = Fused(dim, tuple(zip(names, sizes, strict=True)))
            together = torch.cat(values, dim=dim)
            buffers.append(buffer_before(first_user_input, specs, state, name, together, calls[0]))
        widths = [call.meta["val"].shape[-1] for call in calls]
        # Before the first of the calls: it reads only their input and buffers, and each call's
        # users come after that call.
        with Inserting(graph, calls[0]) as make:
            args = (calls[0].args[0], buffers[0], calls[0].args[2], buffers[1])
            parts = make(_SPLIT, make(_INT4, *args), widths, -1)
            split = [make(operator.getitem, parts, i) for i in range(len(calls))]
        for call, part in zip(calls, split, strict=True):
            call.replace_all_uses_with(part)
            graph.erase_node(call)
    _drop(graph, specs, {name for record in fused.values() for name, _ in record.parts})
    graph.lint()
    graph_module.recompile()
    new_signature = type(signature)(input_specs=specs, output_specs=signature.output_specs)
    return program._update(graph_module, new_signature, state_dict=state), fused


def _alone(call: torch.fx.Node, buffer_of: dict[str, str], keep: Collection[str]) -> bool:
    """Whether the call's weight and table are buffers that it alone reads, none in `keep`."""
    read = (call.args[1], call.args[3])
    return all(
        node.name in buffer_of and len(node.users) == 1 and buffer_of[node.name] not in keep
        for node in read
    )


def _source(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple]:
    """The node an input comes from through ops that change no value, and those ops: two calls
    whose inputs come from one node by the same ops read the same input."""
    steps = []
    while node.op == "call_function" and node.target in _SAME_VALUES:
        steps.append((node.target, tuple(node.args[1:]), tuple(sorted(node.kwargs.items()))))
        node = node.args[0]
    return node, tuple(steps)


def _drop(graph: torch.fx.Graph, specs: list[InputSpec], names: set[str]) -> None:
    """The placeholders and specs of the buffers `names`, which no node reads any more."""
    for node in list(graph.find_nodes(op="placeholder")):
        spec = next(s for s in specs if s.arg.name == node.name)
        if spec.kind is InputKind.BUFFER and spec.target in names:
            graph.erase_node(node)
            specs.remove(spec)
