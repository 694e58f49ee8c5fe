"""A tied embedding (one weight for the input embedding and the LM head) untied in the edge
program for XNNPACK, without copying the weight.

XNNPACK takes the head's linear and leaves the embedding's lookup to the program's own
kernels, so the weight has users in two places; ExecuTorch then gives the delegate a deep copy
of it (`duplicate_constant_node`), held until the program is written: a 1B Llama's 1.05 GB
embedding twice in memory through lowering. Here the head gets a placeholder of its own over the
same tensor, so there is nothing left to copy. The .pte holds the weight twice either way (as
the program's constant and in XNNPACK's data): a program and a delegate share no constants.
"""

from __future__ import annotations

from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from exporter.backends.common.policy import op_name

_LOOKUPS = frozenset({"aten.embedding.default"})
_SUFFIX = "_untied"


class UntiedEmbedding(ExportedProgramPassBase):
    """Gives the ops that read an embedding's weight other than by looking it up (a tied LM
    head) their own parameter over the same tensor."""

    def call(self, program: ExportedProgram) -> ExportedProgramPassResult:
        graph = program.graph_module.graph
        specs = program.graph_signature.input_specs
        by_name = {spec.arg.name: spec for spec in specs if isinstance(spec.arg, TensorArgument)}
        untied: dict[str, InputSpec] = {}
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            spec = by_name.get(node.name)
            readers = [user for user in node.users if op_name(user) not in _LOOKUPS]
            looked_up = len(readers) < len(node.users)
            if spec is None or spec.kind is not InputKind.PARAMETER or not looked_up or not readers:
                continue
            with graph.inserting_before(node):
                head = graph.placeholder(node.name + _SUFFIX)
            head.meta.update(node.meta)
            for user in readers:
                user.replace_input_with(node, head)
            target = spec.target + _SUFFIX
            program.state_dict[target] = program.state_dict[spec.target]
            untied[node.name] = InputSpec(
                InputKind.PARAMETER, TensorArgument(head.name), target, spec.persistent
            )
        if not untied:
            return ExportedProgramPassResult(program, False)
        # A placeholder's spec stands where the placeholder does: just before the tied one's.
        program.graph_signature.input_specs = [
            new for spec in specs for new in _with_untied(spec, untied)
        ]
        program.graph_module.recompile()
        return ExportedProgramPassResult(program, True)


def _with_untied(spec: InputSpec, untied: dict[str, InputSpec]) -> list[InputSpec]:
    name = spec.arg.name if isinstance(spec.arg, TensorArgument) else None
    return [untied[name], spec] if name in untied else [spec]
